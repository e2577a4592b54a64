"""The config schema: every shipped config parses, unknown keys and bad values are errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError, RunConfig, load_config, resolved

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"smoke.yaml", "voice-leading.yaml", "voice-leading-qwen3-4b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # The resolved dict round-trips through the schema unchanged (defaults included).
    assert RunConfig.model_validate(resolved(cfg)) == cfg


# `seed`: four sections declare it, all 0, and 0 is also the reproducible default of every RNG
# helper (a bootstrap, an engine, a task build): a seed=0 there names no one section's setting.
GENERIC_NAMES = {"seed"}
# Copies that predated this check; issue 32 moved the last of them into config/. Do not add to
# it: read the default from the schema (``GraderConfig().host``) instead.
KNOWN_COPIES: dict[str, set[str]] = {}


def _schema_defaults() -> dict[str, list]:
    """Every config field's name -> the defaults the schema gives fields of that name (one per
    section declaring it; a default_factory's value included, None left out: "not given")."""
    import importlib
    import pkgutil

    import config
    from pydantic import BaseModel

    models = set()
    for info in pkgutil.iter_modules(config.__path__):
        mod = importlib.import_module(f"config.{info.name}")
        models |= {o for o in vars(mod).values()
                   if isinstance(o, type) and issubclass(o, BaseModel) and o.__module__ == mod.__name__}
    out: dict[str, list] = {}
    for model in models:
        for name, field in model.model_fields.items():
            if field.is_required():
                continue
            value = field.get_default(call_default_factory=True)
            if value is not None:
                out.setdefault(name, []).append(value)
    return out


def _same(value, default) -> bool:
    """Equal as config values: a tuple is the list it holds; a bool equals only a bool."""
    value, default = (list(v) if isinstance(v, (list, tuple)) else v for v in (value, default))
    return (type(value) is bool) == (type(default) is bool) and value == default


def literal_copies(source: str, defaults: dict[str, list]) -> list[tuple[int, str, object]]:
    """(line, name, value) of every literal in `source` that restates a schema default: a
    parameter default, a class attribute (dataclass field) or a `.get` / `getattr` fallback,
    named like a config field and equal to that field's default."""
    import ast

    def literal(node):
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None

    named: list[tuple[str, ast.AST]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            named += [(p.arg, d) for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)]
            named += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                    named.append((stmt.target.id, stmt.value))
                elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    named.append((stmt.targets[0].id, stmt.value))
        elif isinstance(node, ast.Call):
            f, args = node.func, node.args
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and len(args) == 2:
                key, fallback = args
            elif isinstance(f, ast.Name) and f.id == "getattr" and len(args) == 3:
                key, fallback = args[1], args[2]
            else:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                named.append((key.value, fallback))
    out = []
    for name, node in named:
        value = literal(node)
        if name in defaults and name not in GENERIC_NAMES and value is not None \
                and any(_same(value, d) for d in defaults[name]):
            out.append((node.lineno, name, value))
    return sorted(out)


def _shipped_sources() -> list[Path]:
    """The .py files of every package pyproject.toml ships, config/ excepted."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    found = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = sorted({pattern.rstrip("*") for pattern in found["include"]} - {"config"})
    assert {"graders", "rollout", "learner", "services", "evals", "search"} <= set(packages), packages
    return [p for pkg in packages for p in sorted((repo / pkg).rglob("*.py"))]


def test_defaults_come_from_the_schema_only():
    """No shipped module outside config/ restates a config default as a literal: a parameter,
    a dataclass field or a .get()/getattr() fallback named like a config field and equal to its
    schema default is a second copy, which drifts when the schema's changes (STYLE: defaults
    declared in one place). Code reads the schema (``GraderConfig().max_retries``)."""
    defaults = _schema_defaults()
    assert defaults["max_retries"] and defaults["host"] == ["127.0.0.1"]  # the schema was read
    repo = Path(__file__).resolve().parents[1]
    copies = []
    for path in _shipped_sources():
        rel = path.relative_to(repo).as_posix()
        for line, name, value in literal_copies(path.read_text(encoding="utf-8"), defaults):
            if name not in KNOWN_COPIES.get(rel, set()):
                copies.append(f"{rel}:{line}: {name}={value!r}")
    assert not copies, "defaults restated outside config/:\n" + "\n".join(copies)
    cfg = load_config(None)
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.grader.checker == "reference"
    assert cfg.trainer.metrics_port == 9464


@pytest.mark.parametrize("source", [
    "def serve(core, host='127.0.0.1'):\n    pass",
    "def serve(core, *, port=50051):\n    pass",
    "from dataclasses import dataclass\n@dataclass\nclass Client:\n    max_retries: int = 4",
    "class Client:\n    timeout_s = 60.0",
    "def f(cfg):\n    return cfg.get('group_size', 8)",
    "def f(cfg):\n    return getattr(cfg, 'max_retries', 3)",
    "f = lambda core, host='127.0.0.1': core",
])
def test_a_restated_default_is_found(source):
    """The scan behind test_defaults_come_from_the_schema_only sees each way of restating one."""
    assert [name for _, name, _ in literal_copies(source, _schema_defaults())] != []


def test_other_literals_are_not_copies():
    source = ("def f(host=None, port=0, seed=0, retries=4, group_size='8', timeout_s=61.0, flag=True):\n"
              "    return {}.get('host', '0.0.0.0')")
    assert literal_copies(source, _schema_defaults()) == []


def test_every_field_of_the_schema_says_what_it_is():
    """The schema is where defaults and their meaning live: no field without a description."""
    from pydantic import BaseModel

    missing, seen = [], set()

    def walk(model: type[BaseModel], where: str) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{where}{name}")
            for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    walk(t, f"{where}{name}.")

    walk(RunConfig, "")
    assert len(seen) > 8 and not missing, missing  # every section was walked


def test_the_run_and_counterpoint_eval_share_the_eval_section():
    """One held-out eval configuration: the old trainer.eval_* keys are refused in one line
    naming what replaces them; the run's eval samples as `counterpoint eval` does."""
    for old, new in (("trainer.eval_heldout=true", "eval.before_and_after"), ("trainer.eval_limit=96", "eval.limit"),
                     ("trainer.eval_generations=1", "eval.generations")):
        with pytest.raises(ConfigError, match=rf"{old.split('=')[0]} is now {new}") as info:
            load_config(None, [old])
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="eval.before_and_after evaluates the held-out split"):
        load_config(None, ["eval.before_and_after=true", "eval.split=train"])
    cfg = load_config("configs/voice-leading.yaml")
    assert (cfg.eval.before_and_after, cfg.eval.limit, cfg.eval.generations, cfg.eval.seed) == (True, 96, 1, 0)


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["learner.lr=3e-4", "trainer.steps=5", "learner.lora.target_modules=[q_proj,v_proj]",
                             "model.eos_token_ids=[2, 7]", "learner.entropy_floor=null", "run_name=abc"])
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.trainer.steps == 5
    assert cfg.learner.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.eos_token_ids == [2, 7]
    assert cfg.learner.entropy_floor is None
    assert cfg.run_name == "abc"


def test_unknown_key_is_an_error_naming_it(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"learner\.lrr"):
        load_config(None, ["learner.lrr=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.stepz") as info:
        load_config(bad)
    assert str(bad) in str(info.value)


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.group_size"):
        load_config(None, ["trainer.group_size=1"])
    with pytest.raises(ConfigError, match=r"grader\.style"):
        load_config(None, ["grader.style=baroque"])
    with pytest.raises(ConfigError, match=r"learner\.strategy=deepspeed needs learner\.use_gpu=true"):
        load_config(None, ["learner.strategy=deepspeed"])


def test_malformed_override_and_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["learner.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["seed=1", "seed.x=1"])


@pytest.mark.parametrize("path", [p for p in CONFIGS if "gpu" not in p.name and "qwen3" not in p.name],
                         ids=lambda p: p.name)
def test_cpu_configs_fit_a_two_cpu_local_ray(path: Path):
    """A local Ray on our 2-core machines has 2 CPUs; a run reserving more waits forever."""
    from services.launch import required_resources

    need = required_resources(load_config(path))
    assert need["CPU"] <= 2.0 and need["GPU"] == 0, need


def test_gpu_fraction_keeps_one_rank_per_gpu():
    """learner.gpus_per_worker <= 0.5 with several GPU workers would let Ray put two NCCL ranks
    on one GPU: refused, naming the field."""
    assert load_config(None, ["learner.use_gpu=true", "learner.workers=2", "learner.gpus_per_worker=0.6"])
    with pytest.raises(ConfigError, match="gpus_per_worker"):
        load_config(None, ["learner.use_gpu=true", "learner.workers=2", "learner.gpus_per_worker=0.5"])


@pytest.mark.parametrize("overrides, named", [
    (["rollout.top_p=0.9"], "rollout.top_p=0.9 is refused"),
    (["rollout.top_k=50"], "rollout.top_k=50 is refused"),
    (["rollout.top_p=0.95", "rollout.top_k=20"], "rollout.top_p=0.95 and rollout.top_k=20 are refused"),
])
def test_truncated_rollout_sampling_is_refused_in_one_line(overrides, named):
    """The engines' log-probs are of the top-p/top-k truncated distribution, the learner's of the
    full softmax: ppl_ratio, TIS and the PPO ratio would be wrong, so the config refuses it."""
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS[0].parent / "smoke.yaml", overrides)
    text = str(info.value)
    assert "\n" not in text and named in text and "log_softmax(logits / temperature)" in text
    assert "ppl_ratio" in text and "rollout.top_p=1 and rollout.top_k=-1" in text


def test_untruncated_rollout_and_truncated_eval_sampling_are_accepted():
    for overrides in (["rollout.top_k=-1"], ["rollout.top_k=0"], ["rollout.top_p=1.0"],
                      ["eval.top_p=0.9", "eval.top_k=20"]):  # eval samples never reach the learner
        load_config(CONFIGS[0].parent / "smoke.yaml", overrides)


def test_train_dry_run_refuses_top_p_before_anything_starts(tmp_path: Path):
    from cliharness import cli

    proc = cli("train", "--config", "configs/smoke.yaml", "--set", "rollout.top_p=0.9", "--dry-run",
               "--set", f"trainer.runs_dir={tmp_path / 'runs'}", timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: invalid config configs/smoke.yaml: rollout.top_p=0.9 is refused")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name, overrides, gpus", [
    ("gpu-bench.yaml", [], 1.0),  # replica and learner share ONE GPU by halves
    ("gpu-bench.yaml", ["trainer.prompts_per_step=4", "trainer.mode=one_step_off"], 1.0),
    ("gpu-bench-2gpu.yaml", [], 2.0),  # each on a GPU of its own
    # two replicas, one per GPU: 0.6 each cannot share one; the learner's 0.4 fits beside either
    ("gpu-bench-2gpu.yaml", ["rollout.replicas=2", "rollout.num_gpus=0.6", "learner.gpus_per_worker=0.4"], 1.6),
])
def test_gpu_bench_placements_reserve_what_the_host_has(name, overrides, gpus):
    """The GPU bench configs ask Ray for the GPUs their host has (fractions that add up per GPU):
    a reservation above it would keep a part waiting forever, one below it would leave a GPU idle."""
    from services.launch import required_resources

    cfg = load_config(CONFIGS[0].parent / name, overrides)
    assert required_resources(cfg)["GPU"] == pytest.approx(gpus)
    assert cfg.rollout.engine == "vllm" and cfg.learner.use_gpu and cfg.grader.task == "vowel-share"
    # every part fits on one GPU, and a replica with a learner beside it leaves it room
    assert cfg.rollout.num_gpus <= 1 and cfg.learner.gpus_per_worker <= 1
    if cfg.rollout.num_gpus < 1:
        assert cfg.rollout.num_gpus + cfg.learner.gpus_per_worker <= 1


def test_the_32b_cluster_config_fits_two_nodes_of_eight_gpus(tmp_path: Path):
    """configs/mle-tree-qwen3-32b.yaml names a hub id (nothing is downloaded: the model's shape is
    the shipped configs/shapes/qwen3-32b.json): 2 TP=4 vLLM replicas on one node's 8 GPUs, 8 fsdp2
    learner workers on the other's; it passes every check preflight can make offline at that shape,
    its parts find room on two such nodes, and each GPU's memory fits an 80 GB card."""
    import json

    from rollout.engines.vllm_engine import parallel_shape_problem
    from services.launch import required_resources
    from services.memory_budget import H100_80GB_GIB, cluster_memory, gpu_totals
    from services.placement import Node, needs_of, placement_problems
    from services.preflight import preflight

    path = CONFIGS[0].parent / "mle-tree-qwen3-32b.yaml"
    cfg = load_config(path)
    r, lc = cfg.rollout, cfg.learner
    assert cfg.model.name_or_path == "Qwen/Qwen3-32B" and cfg.model.dtype == "bfloat16"
    assert r.engine == "vllm" and r.num_gpus == r.parallel_size == r.tensor_parallel_size == 4
    assert r.vllm_lora == "unmerged" and r.max_lora_rank >= lc.lora.r == 32 and lc.lora.target_modules == "all-linear"
    # long sequences: a script of 4k tokens after a prompt of thousands, prefilled in chunks, prefixes cached
    assert r.max_tokens == 4096 and r.max_model_len >= r.max_tokens + 8192
    assert r.enable_chunked_prefill and r.enable_prefix_caching and r.max_num_batched_tokens < r.max_model_len
    assert lc.strategy == "fsdp2" and lc.gradient_checkpointing is True and lc.use_gpu and lc.workers == 8
    assert cfg.gpu_sharing.mode == "timeslice" and cfg.trainer.rollout_mode == "tree"
    assert required_resources(cfg)["GPU"] == 16
    # what the schema refuses at this shape: merged LoRA at TP > 1, GPUs per replica other than TP x PP
    with pytest.raises(ConfigError, match="vllm_lora=merged"):
        load_config(path, ["rollout.vllm_lora=merged"])
    with pytest.raises(ConfigError, match="set rollout.num_gpus=8"):
        load_config(path, ["rollout.tensor_parallel_size=8"])
    # every preflight check that needs no service, at the model's real shape (a directory holding
    # only its config.json): the TP size divides its heads, the code-exec pool loads
    shape = json.loads((CONFIGS[0].parent / "shapes" / "qwen3-32b.json").read_text())
    assert parallel_shape_problem(shape, r.tensor_parallel_size) is None
    model = tmp_path / "Qwen3-32B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(shape))
    preflight(load_config(path, [f"model.name_or_path={model}"]), ports=False)
    # two 8-GPU nodes, one offering the replicas' rollout_slot, one the workers' learner_slot (deploy/)
    nodes = [Node("head", True, {}, {"CPU": 8.0}),
             Node("rollout-node", True, {}, {"CPU": 64.0, "GPU": 8.0, "rollout_slot": 2.0}),
             Node("learner-node", True, {}, {"CPU": 96.0, "GPU": 8.0, "learner_slot": 8.0})]
    assert placement_problems(nodes, needs_of(cfg)) == []
    assert r.replicas * r.resources["rollout_slot"] == 2 and r.replicas * r.num_gpus == 8
    assert lc.workers * lc.resources_per_worker["learner_slot"] == 8 and lc.workers * lc.gpus_per_worker == 8
    assert placement_problems(nodes[:2], needs_of(cfg))  # no learner node: refused before start
    totals = gpu_totals(cluster_memory(cfg, shape))
    assert set(totals) == {"rollout", "learner"} and max(totals.values()) <= H100_80GB_GIB, totals
