"""deploy/: every manifest parses and holds what its tool needs (structure, not a cluster)."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from config import GraderConfig, load_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def yaml_docs(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kind_doc(path: Path, kind: str) -> dict:
    (doc,) = [d for d in yaml_docs(path) if d.get("kind") == kind]
    return doc


def gpu_limit(group: dict) -> int:
    (container,) = group["template"]["spec"]["containers"]
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(REPO) for p in DEPLOY.rglob("*") if p.suffix in {".yml", ".yaml"}),
    ids=str,
)
def test_every_yaml_parses(path):
    assert yaml_docs(REPO / path), f"{path} holds no document"


def test_rayjob_train():
    job = kind_doc(DEPLOY / "kuberay" / "rayjob-train.yaml", "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["counterpoint", "train", "--config", "configs/voice-leading-qwen3-4b.yaml"]
    # The entrypoint's config and overrides must load under the real schema.
    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    cfg = load_config(REPO / argv[3], overrides)
    assert cfg.trainer.ray_address == "auto"

    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert gpu_limit(head) == 0
    (head_container,) = head["template"]["spec"]["containers"]
    assert cfg.trainer.metrics_port in {p["containerPort"] for p in head_container["ports"]}
    # The graders it calls refuse calls without their token: the driver (on the head) sends the
    # same secret's value under the env var its config names.
    graders = kind_doc(DEPLOY / "kuberay" / "rayservice-graders.yaml", "RayService")
    grader_envs = {a["args"]["token_env"] for a in yaml.safe_load(graders["spec"]["serveConfigV2"])["applications"]}
    assert cfg.grader.address and grader_envs == {cfg.grader.token_env}
    (env,) = [e for e in head_container.get("env", []) if e["name"] == cfg.grader.token_env]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "counterpoint-grader-token", "key": "token"}
    workers = cluster["workerGroupSpecs"]
    assert workers and all(gpu_limit(group) >= 1 for group in workers)
    needed = cfg.rollout.replicas * cfg.rollout.num_gpus + (
        cfg.learner.workers if cfg.learner.use_gpu else 0
    )
    assert sum(gpu_limit(g) * g["replicas"] for g in workers) >= needed


def test_rayservice_graders():
    from ray.serve.schema import ServeDeploySchema  # pydantic only; starts nothing

    service = kind_doc(DEPLOY / "kuberay" / "rayservice-graders.yaml", "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    app, code_exec = serve_config["applications"]
    assert app["import_path"] == code_exec["import_path"] == "graders.serve_app:build_app"
    assert IMPORT_PATH.match(app["import_path"])
    assert (REPO / "graders").is_dir()
    assert set(app["args"]) == {"voices", "style", "checker", "fixture", "token_env"}
    for application in (app, code_exec):
        # the args are GraderConfig fields (build_app's own parse)
        assert GraderConfig(**application["args"]).token_env == "COUNTERPOINT_GRADER_TOKEN"
        for deployment in application["deployments"]:
            scaling = deployment["autoscaling_config"]
            assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
            assert 0 < scaling["target_ongoing_requests"] <= deployment["max_ongoing_requests"]
    assert len({a["route_prefix"] for a in serve_config["applications"]}) == 2
    assert GraderConfig(**code_exec["args"]).code_exec.min_isolation == "namespaces"
    # Serve's gRPC proxy imports these by path: they must import here too.
    for path in serve_config["grpc_options"]["grpc_servicer_functions"]:
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))
    # code-exec replicas land only on the sandbox group, whose pods hold the isolation's context
    (deployment,) = code_exec["deployments"]
    actor = deployment["ray_actor_options"]
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    offering = [g for g in groups if "sandbox" in json.loads(yaml.safe_load(
        g["rayStartParams"].get("resources", '"{}"')))]
    assert [g["groupName"] for g in offering] == ["sandbox"] and actor["resources"] == {"sandbox": 1}
    (container,) = offering[0]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert "SYS_ADMIN" in context["capabilities"]["add"] and not context.get("privileged")
    assert context.get("allowPrivilegeEscalation") is not False  # the API refuses it beside SYS_ADMIN
    pod_cpu = float(container["resources"]["limits"]["cpu"])
    assert actor["num_cpus"] <= pod_cpu and actor["num_cpus"] >= GraderConfig(
        **code_exec["args"]).code_exec.max_concurrent
    grpc_service = kind_doc(DEPLOY / "kuberay" / "rayservice-graders.yaml", "Service")
    assert grpc_service["spec"]["ports"][0]["port"] == serve_config["grpc_options"]["port"]


def test_ray_cluster_launcher():
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    workers = [name for name in types if name != cluster["head_node_type"]]
    assert workers and all(types[w]["max_workers"] >= types[w]["min_workers"] for w in workers)
    assert any("counterpoint[train,vllm,deepspeed]" in cmd for cmd in cluster["setup_commands"])
    assert any("ray start --head" in cmd for cmd in cluster["head_start_ray_commands"])


def test_dockerfile():
    lines = [line.strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()]
    assert lines[[i for i, l in enumerate(lines) if l and not l.startswith("#")][0]].startswith(
        "FROM python:3.11"
    )
    text = "\n".join(lines)
    assert 'pip install ".[train,vllm,deepspeed]"' in text
    copied = {l.split()[1] for l in lines if l.startswith("COPY ")}
    for package in ("graders", "rollout", "learner", "services"):
        assert package in copied, f"Dockerfile does not COPY {package}/"
    for source in copied - {"README.md*"}:
        assert (REPO / source).exists(), f"Dockerfile copies missing {source}"


def test_grafana_dashboard_and_provisioning():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "counterpoint.json").read_text())
    (datasource,) = yaml.safe_load(
        (DEPLOY / "grafana" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    assert datasource["type"] == "prometheus"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        own = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
               for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not own & cells, f"panel {panel['title']!r} overlaps another"
        cells |= own
    (provider,) = yaml.safe_load(
        (DEPLOY / "grafana" / "dashboards" / "dashboards.yaml").read_text()
    )["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_search_dashboard_plots_the_ladder_by_rung():
    """The tree dashboard draws the round against the task's reference ladder from the labelled
    series (one line per rung and stat), with 0 (= the rung) marked."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "counterpoint-search.json").read_text())
    (panel,) = [p for p in dashboard["panels"]
                if any(t.get("expr") == "counterpoint_search_vs_ladder" for t in p.get("targets", []))]
    (target,) = panel["targets"]
    assert "{{rung}}" in target["legendFormat"] and "{{stat}}" in target["legendFormat"]
    assert [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 0]
    assert any(t.get("expr") == "counterpoint_search_selection_metric"
               for p in dashboard["panels"] for t in p.get("targets", []))


def test_ppl_ratio_panel_draws_alert_band():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "counterpoint.json").read_text())
    (panel,) = [p for p in dashboard["panels"]
                if any(t["expr"] == "counterpoint_ppl_ratio" for t in p["targets"])]
    steps = [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 0.9, 1.1]
    assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"


def _declared_packages() -> set[str]:
    """Top-level packages pyproject.toml's setuptools find section includes, found as setuptools
    finds them."""
    import tomllib

    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return {name.split(".")[0] for name in find_packages(where=str(REPO), include=find["include"])}


def _dockerfile_copies() -> list[tuple[str, str]]:
    """(source, destination) of each COPY line of deploy/Dockerfile (sources of one line split)."""
    out = []
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"]:
            *sources, dest = parts[1:]
            out += [(src, dest) for src in sources]
    return out


def test_dockerfile_copies_exactly_the_packages_pyproject_declares():
    declared = _declared_packages()
    assert {"config", "graders", "rollout", "learner", "services", "evals", "search"} <= declared
    copied_packages = {src for src, _ in _dockerfile_copies() if (REPO / src / "__init__.py").is_file()}
    assert copied_packages == declared, (
        f"Dockerfile COPYs packages {sorted(copied_packages)}, pyproject.toml declares {sorted(declared)}")


def test_an_install_the_way_the_image_installs_imports_every_package_and_runs(tmp_path):
    """The sources the Dockerfile copies, installed non-editable (as its `pip install .` does)
    into a fresh venv that borrows this environment's third-party packages (a plain path line:
    the site-packages' own .pth files, the editable install of the checkout among them, stay
    off), import every declared package from the venv and run `counterpoint --help` and
    `counterpoint train --dry-run`. No network: --no-deps --no-build-isolation --no-index."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig

    image = tmp_path / "opt-counterpoint"  # the image's WORKDIR, as the COPY lines fill it
    image.mkdir()
    for src, dest in _dockerfile_copies():
        for path in REPO.glob(src):
            target = image / (path.name if dest.endswith("/") and dest.rstrip("/") in (".", "") else dest)
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(path, target)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "borrowed_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "elsewhere"  # no checkout on the path: the current directory is empty
    work.mkdir()

    def run(*cmd: str, cwd: Path = work) -> subprocess.CompletedProcess:
        done = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-3000:])
        return done

    run(str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
        "--disable-pip-version-check", str(image))
    packages = sorted(_declared_packages())
    probe = "import importlib, json; print(json.dumps({p: importlib.import_module(p).__file__ for p in %r}))"
    where = run(str(py), "-c", probe % packages).stdout
    files = json.loads(where)
    assert sorted(files) == packages
    for package, file in files.items():
        assert file and Path(file).is_relative_to(venv), f"{package} imported from {file}, not the installed copy"
    assert (Path(files["graders"]).parent / "voice_leading" / "data" / "train.json").is_file()  # package data came along
    counterpoint = str(venv / "bin" / "counterpoint")
    assert "train" in run(counterpoint, "--help").stdout
    shown = json.loads(run(counterpoint, "train", "--config", "configs/smoke.yaml", "--dry-run",
                           "--set", f"trainer.runs_dir={tmp_path / 'runs'}", cwd=image).stdout)
    assert shown["config"]["model"]["name_or_path"] == "tiny-random" and shown["receipt"]["status"] == "dry_run"
    assert not (tmp_path / "runs").exists()


def _offered(start_params: dict) -> dict[str, float]:
    """The custom resources a group's `ray start` offers (rayStartParams.resources: a quoted JSON)."""
    raw = start_params.get("resources")
    return json.loads(yaml.safe_load(raw)) if raw else {}


def test_rayjob_train_32b():
    """Two 8-GPU pods, one offering the config's rollout_slot and one its learner_slot, hold every
    replica and worker of configs/mle-tree-qwen3-32b.yaml (services/placement.py's rule per replica
    and worker, and the totals per pod); the driver calls the RayService's code-exec app."""
    from services.launch import required_resources
    from services.placement import Node, fitting_nodes, needs_of, placement_problems

    job = kind_doc(DEPLOY / "kuberay" / "rayjob-train-32b.yaml", "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["counterpoint", "train", "--config", "configs/mle-tree-qwen3-32b.yaml"]
    cfg = load_config(REPO / argv[3], [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"])
    assert cfg.trainer.ray_address == "auto" and cfg.grader.app_name == "code-exec"
    graders = kind_doc(DEPLOY / "kuberay" / "rayservice-graders.yaml", "RayService")
    apps = {a["name"]: a for a in yaml.safe_load(graders["spec"]["serveConfigV2"])["applications"]}
    assert apps[cfg.grader.app_name]["args"]["task"] == cfg.grader.task == "code-exec"
    assert apps[cfg.grader.app_name]["args"]["token_env"] == cfg.grader.token_env
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    (head_container,) = head["template"]["spec"]["containers"]
    assert gpu_limit(head) == 0 and cfg.trainer.metrics_port in {p["containerPort"] for p in head_container["ports"]}
    (env,) = [e for e in head_container["env"] if e["name"] == cfg.grader.token_env]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "counterpoint-grader-token", "key": "token"}
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout", "learner"} and all(g["replicas"] == 1 and gpu_limit(g) == 8 for g in groups.values())
    assert sum(gpu_limit(g) for g in groups.values()) == required_resources(cfg)["GPU"] == 16

    def node(name: str, group: dict) -> Node:
        (container,) = group["template"]["spec"]["containers"]
        return Node(name, True, {}, {"CPU": float(container["resources"]["limits"]["cpu"]),
                                     "GPU": float(gpu_limit(group)), **_offered(group["rayStartParams"])})

    nodes = [node(name, g) for name, g in groups.items()]
    assert placement_problems(nodes, needs_of(cfg)) == []
    r, lc = cfg.rollout, cfg.learner
    rollout_need, learner_need = needs_of(cfg)[:2]
    # each part lands on its own pod only, and that pod holds all of it
    (pod,) = fitting_nodes(nodes, rollout_need)
    assert pod.node_id == "rollout" and r.replicas * r.num_gpus <= pod.resources["GPU"]
    assert r.replicas * r.num_cpus <= pod.resources["CPU"] and r.replicas <= pod.resources["rollout_slot"]
    (pod,) = fitting_nodes(nodes, learner_need)
    assert pod.node_id == "learner" and lc.workers * lc.gpus_per_worker <= pod.resources["GPU"]
    assert lc.workers * lc.num_cpus_per_worker <= pod.resources["CPU"] and lc.workers <= pod.resources["learner_slot"]
    for group in groups.values():  # vLLM's TP ranks and NCCL need more than the default 64 MiB /dev/shm
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_ray_cluster_launcher_32b():
    """deploy/ray/cluster-32b.yaml: a rollout node and a learner node of 8 GPUs, offering the
    config's custom resources, hold its replicas and workers; the head holds its graders."""
    from services.placement import Node, needs_of, placement_problems

    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster-32b.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] == "head" and set(types) == {"head", "rollout-node", "learner-node"}
    assert all(types[t]["min_workers"] == types[t]["max_workers"] == 1 for t in ("rollout-node", "learner-node"))
    cfg = load_config(REPO / "configs" / "mle-tree-qwen3-32b.yaml")
    nodes = [Node(name, True, {}, {k: float(v) for k, v in t["resources"].items()}) for name, t in types.items()]
    assert placement_problems(nodes, needs_of(cfg)) == []
    assert types["rollout-node"]["resources"]["rollout_slot"] == cfg.rollout.replicas
    assert types["learner-node"]["resources"]["learner_slot"] == cfg.learner.workers
    assert types["head"]["resources"]["CPU"] >= cfg.grader.replicas * cfg.grader.num_cpus + 1
    assert any("counterpoint[train,vllm,deepspeed]" in cmd for cmd in cluster["setup_commands"])
