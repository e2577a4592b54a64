"""gpu_sharing (config/gpu_sharing.py) and CUDA MPS for a run (services/mps.py): the rule as a
table, the config's refusals, and the daemon's start, join and quit through a stand-in for
nvidia-cuda-mps-control (this box has no GPU and no driver; the real daemon is exercised on the
H200 by bench/device/session.sh)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from config import RunConfig
from services.mps import MAX_PIPE_DIR_CHARS, GpuSharing, MpsPlan, find_control_binary, plan_mps

SHARES = {"rollout": 100, "learner": 50}
RUN = Path("/runs/r1")


def plan(mode="mps", environ=None, answering=(), binary="/bin/mps-control", run_dir=RUN, shares=SHARES, blocker=None):
    return plan_mps(mode, shares, environ or {}, run_dir, lambda d: d in answering, binary, blocker)


@pytest.mark.parametrize("case, kwargs, action, pipe_dir", [
    ("timeslice does nothing, even with a daemon up", dict(mode="timeslice", answering=("/tmp/nvidia-mps",)),
     "none", None),
    ("a daemon at the default pipe is joined", dict(answering=("/tmp/nvidia-mps",)), "join", "/tmp/nvidia-mps"),
    ("a daemon at the user's pipe is joined", dict(environ={"CUDA_MPS_PIPE_DIRECTORY": "/x/p"}, answering=("/x/p",)),
     "join", "/x/p"),
    ("the user's pipe wins over a daemon at the default one",
     dict(environ={"CUDA_MPS_PIPE_DIRECTORY": "/x/p"}, answering=("/tmp/nvidia-mps",)), "start", "/x/p"),
    ("no daemon: the run starts its own under the run directory", {}, "start", "/runs/r1/mps/pipe"),
    ("a run directory too deep for a socket: under /tmp instead",
     dict(run_dir=Path("/r") / ("d" * MAX_PIPE_DIR_CHARS)), "start", ""),
    ("auto with a reason against MPS time-slices, even with a daemon up",
     dict(mode="auto", blocker="trainer.mode=sync: ...", answering=("/tmp/nvidia-mps",)), "none", None),
    ("auto without the control binary time-slices", dict(mode="auto", binary=None), "none", None),
    ("auto where MPS pays joins a daemon that answers", dict(mode="auto", answering=("/tmp/nvidia-mps",)),
     "join", "/tmp/nvidia-mps"),
    ("auto where MPS pays and no daemon answers: the run starts its own", dict(mode="auto"), "start",
     "/runs/r1/mps/pipe"),
])
def test_plan_table(case, kwargs, action, pipe_dir):
    got = plan(**kwargs)
    assert (got.action, got.pipe_dir) == (action, pipe_dir), case
    if kwargs.get("mode") == "auto":  # the reason says auto chose, and why
        assert got.reason.startswith("gpu_sharing.mode=auto: " + ("MPS" if action != "none" else "time-sliced, as "))
        assert kwargs.get("blocker", "") in got.reason and "\n" not in got.reason


def test_auto_reason_names_the_blocker_or_the_missing_binary():
    assert plan(mode="auto", blocker="learner.use_gpu=false (a CPU learner)").reason == \
        "gpu_sharing.mode=auto: time-sliced, as learner.use_gpu=false (a CPU learner)"
    assert plan(mode="auto", binary=None).reason == \
        "gpu_sharing.mode=auto: time-sliced, as nvidia-cuda-mps-control is not on this host"


def test_plan_env_per_role():
    started = plan()
    assert started.env("learner") == {"CUDA_MPS_PIPE_DIRECTORY": "/runs/r1/mps/pipe",
                                      "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert started.env("rollout") == {"CUDA_MPS_PIPE_DIRECTORY": "/runs/r1/mps/pipe"}  # 100%: no cap set
    assert started.log_dir == "/runs/r1/mps/log"
    assert plan(mode="timeslice").env("learner") == {}
    joined = plan(environ={"CUDA_MPS_LOG_DIRECTORY": "/logs"}, answering=("/tmp/nvidia-mps",))
    assert joined.log_dir == "/logs" and joined.env("rollout") == {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}


def test_a_below_normal_learner_gets_the_client_priority_and_the_replica_does_not():
    levels = {"learner": "below_normal"}
    for got in (plan_mps("mps", SHARES, {}, RUN, lambda d: False, "/bin/mps-control", priority=levels),
                plan_mps("auto", SHARES, {}, RUN, lambda d: d == "/tmp/nvidia-mps", "/bin/mps-control", priority=levels)):
        assert got.env("learner") == {"CUDA_MPS_PIPE_DIRECTORY": got.pipe_dir,
                                      "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_CLIENT_PRIORITY": "1"}
        assert "CUDA_MPS_CLIENT_PRIORITY" not in got.env("rollout")
        assert got.priority == {"rollout": "normal", "learner": "below_normal"}
    assert "CUDA_MPS_CLIENT_PRIORITY" not in plan().env("learner")  # normal: CUDA's own default, nothing set
    assert plan_mps("auto", SHARES, {}, RUN, lambda d: False, None, priority=levels).env("learner") == {}


def test_plan_without_control_binary_is_one_line():
    with pytest.raises(ValueError, match="nvidia-cuda-mps-control is neither on PATH") as err:
        plan(binary=None)
    assert "\n" not in str(err.value)
    assert plan(mode="timeslice", binary=None).action == "none"  # nothing needed then
    assert plan(mode="auto", binary=None).action == "none"  # auto never fails for want of MPS


GPU_RUN = {"rollout": {"num_gpus": 0.4}, "learner": {"use_gpu": True, "gpus_per_worker": 0.6}}


@pytest.mark.parametrize("tree, needle", [
    ({"gpu_sharing": {"mode": "mps"}}, "rollout.num_gpus=0"),
    ({"gpu_sharing": {"mode": "mps"}, "rollout": {"num_gpus": 0.4}}, "learner.use_gpu=false"),
    ({"gpu_sharing": {"mode": "mps"}, **GPU_RUN, "trainer": {"ray_address": "10.0.0.1:6379"}},
     "trainer.ray_address=10.0.0.1:6379"),
    ({"gpu_sharing": {"mode": "mps", "learner_sm_percent": 0}, **GPU_RUN}, "learner_sm_percent"),
    ({"gpu_sharing": {"mode": "mps", "rollout_sm_percent": 101}, **GPU_RUN}, "rollout_sm_percent"),
    ({"gpu_sharing": {"mode": "green"}}, "mode"),
    ({"gpu_sharing": {"mode": "mps", "learner_priority": "high"}, **GPU_RUN}, "learner_priority"),
    # a priority beside mode=timeslice would do nothing: refused, not ignored
    ({"gpu_sharing": {"mode": "timeslice", "learner_priority": "below_normal"}, **GPU_RUN},
     "gpu_sharing.learner_priority=below_normal applies under MPS only"),
])
def test_config_refuses(tree, needle):
    from config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=needle):
        config_from_dict(tree, "test")


def test_a_timeslice_config_written_out_whole_loads_again():
    """run.json carries every field, defaults included: a resume must read it back."""
    for tree in ({"gpu_sharing": {"mode": "timeslice"}}, {"gpu_sharing": {"mode": "timeslice",
                                                                          "learner_sm_percent": 30}}):
        cfg = RunConfig(**tree, **GPU_RUN)
        assert RunConfig.model_validate(cfg.model_dump()) == cfg


def test_config_accepts_mps_on_a_shared_gpu_and_defaults_to_auto():
    assert RunConfig().gpu_sharing.mode == "auto"
    cfg = RunConfig(gpu_sharing={"mode": "mps", "learner_sm_percent": 40}, **GPU_RUN)
    assert cfg.gpu_sharing.learner_sm_percent == 40
    RunConfig(gpu_sharing={"mode": "auto"})  # auto is never refused: it time-slices where MPS cannot be had


ONE_STEP_OFF = {**GPU_RUN, "trainer": {"mode": "one_step_off"}}


@pytest.mark.parametrize("tree, blocker", [
    ({}, "rollout.num_gpus=0 (a CPU-only rollout)"),
    ({**ONE_STEP_OFF, "learner": {"use_gpu": False}}, "learner.use_gpu=false (a CPU learner)"),
    ({**ONE_STEP_OFF, "rollout": {"num_gpus": 0.4, "replicas": 2}}, "rollout.replicas=2 and learner.workers=1"),
    ({**ONE_STEP_OFF, "learner": {"use_gpu": True, "gpus_per_worker": 0.6, "workers": 2}},
     "rollout.replicas=1 and learner.workers=2"),
    ({**ONE_STEP_OFF, "rollout": {"num_gpus": 1}}, "rollout.num_gpus=1 and learner.gpus_per_worker=0.6 add up"),
    (GPU_RUN, "trainer.mode=sync: generation and the update take turns"),
    ({**ONE_STEP_OFF, "rollout": {"num_gpus": 0.4, "engine": "hf"}}, "rollout.engine=hf"),
    ({**GPU_RUN, "trainer": {"mode": "one_step_off", "ray_address": "10.0.0.1:6379"}}, "trainer.ray_address=10.0.0.1"),
    (ONE_STEP_OFF, None),
    ({**ONE_STEP_OFF, "rollout": {"num_gpus": 0.4, "engine": "vllm"}}, None),
])
def test_auto_blocker_table(tree, blocker):
    got = RunConfig(**tree).gpu_sharing_auto_blocker()
    assert got == blocker if blocker is None else (got or "").startswith(blocker), got


def test_preflight_names_the_missing_binary(monkeypatch, tmp_path):
    from services import mps
    from services.preflight import PreflightError, check_gpu_sharing

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mps, "DRIVER_BIN_DIRS", ())
    cfg = RunConfig(gpu_sharing={"mode": "mps"}, **GPU_RUN)
    with pytest.raises(PreflightError, match="gpu_sharing.mode=mps, but nvidia-cuda-mps-control"):
        check_gpu_sharing(cfg)
    check_gpu_sharing(RunConfig(gpu_sharing={"mode": "timeslice"}))  # timeslice needs no binary
    check_gpu_sharing(RunConfig(gpu_sharing={"mode": "auto"}, **ONE_STEP_OFF))  # auto time-slices without one


# A stand-in for the control binary: `-d` makes the daemon's control socket (a file here) and
# logs the call; on stdin, get_server_list answers 0 only while the "daemon" is up, quit ends it.
STAND_IN = """#!/bin/sh
echo "$CUDA_MPS_PIPE_DIRECTORY ${1:-stdin} ${CUDA_MPS_LOG_DIRECTORY:-}" >> "$MPS_CALLS"
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read cmd
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
if [ "$cmd" = "quit" ]; then rm "$CUDA_MPS_PIPE_DIRECTORY/control"; fi
exit 0
"""


@pytest.fixture
def control_binary(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    binary = bin_dir / "nvidia-cuda-mps-control"
    binary.write_text(STAND_IN)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    smi = bin_dir / "nvidia-smi"  # the GPU model auto asks for: one where MPS was measured to pay
    smi.write_text('#!/bin/sh\necho "0, GPU-aaaa, ${FAKE_GPU_NAME:-NVIDIA H200}"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("MPS_CALLS", str(tmp_path / "calls.log"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    # the GEMM check of a capped role (model/gemm_check.py needs CUDA here): a client that logs
    # the variables it got and answers as the check does; FAKE_GEMMS=off makes it find wrong GEMMs
    from services import mps

    def stand_in_check(spec):
        return ("/bin/sh", "-c", f"""echo "check $CUDA_MPS_PIPE_DIRECTORY ${{CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-100}} \
{spec['tokens']}" >> "$MPS_CALLS"
if [ "$FAKE_GEMMS" = off ]; then echo '{WRONG_GEMMS}'; exit 1; fi
echo '{{"ok": true, "sm_count": 66, "checked": 70, "worst": {{"name": "base 2560->4096 forward at 4672 tokens", "error": 0.003}}, "off": []}}'""")

    monkeypatch.setattr(mps, "numerics_command", stand_in_check)
    monkeypatch.delenv("FAKE_GEMMS", raising=False)
    return binary


# what model/gemm_check.py printed at 60% of an H100's SMs (bench/mps_numerics.py)
WRONG_GEMMS = ('{"ok": false, "sm_count": 78, "checked": 70, "worst": {"name": "lora_A 2560->32 forward at 4672 tokens", '
               '"error": Infinity}, "off": ["lora_A 2560->32 forward at 4672 tokens", "lora_A 2560->32 dgrad at 4672 tokens"]}')


def test_run_starts_its_daemon_and_quits_it(control_binary, tmp_path, monkeypatch, request):
    from services import mps

    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon-here"))
    # a run directory short enough for the daemon's socket path (pytest's tmp_path under xdist is
    # not: the plan then puts the pipe under /tmp, the other table row of test_plan)
    run_dir = Path(tempfile.mkdtemp(prefix="cp-mps-test-", dir="/tmp")) / "run"
    request.addfinalizer(lambda: shutil.rmtree(run_dir.parent, ignore_errors=True))
    assert len(str(run_dir.resolve() / "mps" / "pipe")) <= MAX_PIPE_DIR_CHARS
    cfg = RunConfig(gpu_sharing={"mode": "mps", "learner_priority": "below_normal"}, **GPU_RUN)
    gpu = GpuSharing.for_run(cfg, run_dir)
    assert find_control_binary() == str(control_binary)
    gpu.start()
    pipe = run_dir.resolve() / "mps" / "pipe"
    assert (pipe / "control").exists() and (run_dir / "mps" / "log").is_dir()
    assert gpu.env("learner") == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                                  "CUDA_MPS_CLIENT_PRIORITY": "1"}
    gpu.stop()
    assert not (pipe / "control").exists()
    record = gpu.record()
    assert record["daemon"] == "start" and record["quit"] == "ok" and record["sm_percent"] == SHARES
    assert record["priority"] == {"rollout": "normal", "learner": "below_normal"}
    calls = (tmp_path / "calls.log").read_text().split("\n")
    assert f"{pipe} -d {run_dir.resolve()}/mps/log" in calls  # the daemon got its log directory
    assert calls[-2].startswith(str(pipe)) and "stdin" in calls[-2]  # quit last


def test_a_capped_role_runs_the_gemm_check_under_its_share(control_binary, tmp_path, monkeypatch, request):
    """A capped MPS client can compute wrong numbers (an H100 at 60-80% of the SMs): the learner's
    role is checked as a client with its own variables before any GPU process of the run exists;
    the replica at 100% is not."""
    from services import mps

    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon-here"))
    run_dir = Path(tempfile.mkdtemp(prefix="cp-mps-test-", dir="/tmp")) / "run"
    request.addfinalizer(lambda: shutil.rmtree(run_dir.parent, ignore_errors=True))
    pipe = run_dir.resolve() / "mps" / "pipe"
    gpu = GpuSharing.for_run(RunConfig(gpu_sharing={"mode": "mps"}, **ONE_STEP_OFF), run_dir)
    gpu.start()
    checks = [c for c in (tmp_path / "calls.log").read_text().splitlines() if c.startswith("check ")]
    assert checks == [f"check {pipe} 50 [3072, 2305, 1025, 257]"]  # micro_batch_size 8 x (max_tokens 128 + 256), below
    gpu.stop()
    assert gpu.record()["numerics"] == {"learner": {
        "sm_percent": 50, "ok": True, "sm_count": 66, "checked": 70,
        "worst": {"name": "base 2560->4096 forward at 4672 tokens", "error": 0.003}}}

    # wrong GEMMs under the share: mode=mps refuses in one line and quits its daemon
    monkeypatch.setenv("FAKE_GEMMS", "off")
    asked = GpuSharing.for_run(RunConfig(gpu_sharing={"mode": "mps", "learner_sm_percent": 60}, **ONE_STEP_OFF), run_dir)
    with pytest.raises(RuntimeError) as err:
        asked.start()
    line = str(err.value)
    assert "\n" not in line and line.startswith("gpu_sharing.mode=mps: under MPS with learner_sm_percent=60 ")
    assert "2 of 70 of an adapted layer's GEMMs came out wrong under it (worst: lora_A 2560->32 forward at 4672 " \
           "tokens, off by inf of the result's scale" in line
    assert line.endswith("or gpu_sharing.mode=timeslice")
    assert not asked.started and not (pipe / "control").exists()
    # mode=auto time-slices instead, saying why
    auto = GpuSharing.for_run(RunConfig(**ONE_STEP_OFF), run_dir)
    auto.probe_command = ("/bin/sh", "-c", "exit 0")
    auto.start()
    record = auto.record()
    assert not auto.started and auto.env("learner") == {} and not (pipe / "control").exists()
    assert (record["mode"], record["daemon"]) == ("timeslice", "none")
    assert record["reason"].startswith("gpu_sharing.mode=auto: time-sliced, as under MPS with learner_sm_percent=50 "
                                       "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) 2 of 70")
    assert record["numerics"]["learner"]["ok"] is False


def test_gemm_check_specs_follow_the_run(tmp_path):
    """The check runs the run's model widths at its LoRA rank and token counts; a model whose
    config.json is not on this host (a hub id) gets Qwen3-4B's widths, and run.json says so."""
    from services.mps import numerics_command, numerics_specs

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, '
                                       '"num_key_value_heads": 2, "intermediate_size": 96, "num_hidden_layers": 2, '
                                       '"vocab_size": 128}')
    cfg = RunConfig.model_validate({**ONE_STEP_OFF, "model": {"name_or_path": str(model)},
                                    "learner": {**ONE_STEP_OFF["learner"], "lora": {"r": 8}, "micro_batch_tokens": 3000},
                                    "rollout": {"num_gpus": 0.4, "max_num_seqs": 48}})
    specs = numerics_specs(cfg)
    assert specs["learner"]["widths"] == [[64, 128], [64, 64], [128, 64], [64, 96], [96, 64]]
    assert (specs["learner"]["rank"], specs["learner"]["tokens"], specs["rollout"]["tokens"]) == (
        8, [3000, 2251, 1001, 257], [8, 48])
    assert specs["learner"]["widths_from"] == str(model / "config.json")
    hub = numerics_specs(RunConfig.model_validate({**ONE_STEP_OFF, "model": {"name_or_path": "some-org/Unshipped-7B"}}))
    assert hub["learner"]["widths"][0] == [2560, 4096] and "no config.json readable" in hub["learner"]["widths_from"]
    assert "widths_from" not in numerics_command(specs["learner"])[-1]


def test_gemm_check_failures_read_in_one_line(tmp_path):
    """numerics_fail on real processes: a pass, wrong GEMMs, a crash, a hang."""
    from services.mps import numerics_fail

    why, result = numerics_fail(("/bin/sh", "-c", "echo '{\"ok\": true, \"checked\": 3}'"), {})
    assert why is None and result["checked"] == 3
    why, result = numerics_fail(("/bin/sh", "-c", f"echo noise; echo '{WRONG_GEMMS}'; exit 1"), {})
    assert why.startswith("2 of 70 of an adapted layer's GEMMs came out wrong under it (worst: lora_A") and result["sm_count"] == 78
    why, _ = numerics_fail(("/bin/sh", "-c", "echo 'RuntimeError: CUDA error: no device' >&2; exit 1"), {})
    assert why == "its GEMM check exited 1: RuntimeError: CUDA error: no device"
    why, _ = numerics_fail(("/bin/sh", "-c", "sleep 5"), {}, timeout=0.2)
    assert why.startswith("its GEMM check did not finish (TimeoutExpired")


def test_run_joins_a_running_daemon_and_leaves_it(control_binary, tmp_path, monkeypatch):
    pipe = tmp_path / "theirs"
    pipe.mkdir()
    (pipe / "control").touch()  # a daemon the user started
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    gpu = GpuSharing.for_run(RunConfig(gpu_sharing={"mode": "mps"}, **GPU_RUN), tmp_path / "run")
    gpu.start()
    gpu.stop()
    assert (pipe / "control").exists()  # still theirs, still running
    assert gpu.record()["daemon"] == "join" and "quit" not in gpu.record()
    assert " -d " not in (tmp_path / "calls.log").read_text()


def test_a_daemon_that_does_not_come_up_fails_in_one_line(tmp_path):
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text("#!/bin/sh\necho 'cannot open log' >&2\nexit 3\n")
    binary.chmod(0o755)
    gpu = GpuSharing(MpsPlan("start", "test", str(tmp_path / "p"), str(tmp_path / "l"), SHARES), str(binary))
    with pytest.raises(RuntimeError, match=r"gpu_sharing.mode=mps: .* did not start a daemon .*exit 3: cannot open log"):
        gpu.start()
    assert gpu.record()["quit"] is None and not gpu.started

    # mode=auto asked for nothing in particular: before any GPU process exists it time-slices instead
    auto = GpuSharing(MpsPlan("start", "test", str(tmp_path / "p"), str(tmp_path / "l"), SHARES), str(binary), "auto")
    auto.start()
    record = auto.record()
    assert not auto.started and auto.env("learner") == {} and auto.env("rollout") == {}
    assert record["mode"] == "timeslice" and record["requested"] == "auto" and record["daemon"] == "none"
    assert record["reason"].startswith("gpu_sharing.mode=auto: time-sliced, as ") and "exit 3: cannot open log" in record["reason"]


def test_auto_run_where_mps_pays_starts_the_daemon(control_binary, tmp_path, monkeypatch, request):
    from services import mps

    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-daemon-here"))
    run_dir = Path(tempfile.mkdtemp(prefix="cp-mps-test-", dir="/tmp")) / "run"
    request.addfinalizer(lambda: shutil.rmtree(run_dir.parent, ignore_errors=True))
    gpu = GpuSharing.for_run(RunConfig(**ONE_STEP_OFF), run_dir)
    pipe = run_dir.resolve() / "mps" / "pipe"
    # the client check: a process that sees the daemon's pipe, as a CUDA client would
    gpu.probe_command = ("/bin/sh", "-c", f'test "$CUDA_MPS_PIPE_DIRECTORY" = "{pipe}" && test -e "{pipe}/control"')
    gpu.start()
    assert gpu.started and gpu.env("learner")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    gpu.stop()
    record = gpu.record()
    assert (record["mode"], record["requested"], record["daemon"], record["quit"]) == ("mps", "auto", "start", "ok")

    # a GPU whose MPS server takes no client (MPS is documented for data-center and workstation
    # GPUs): auto quits the daemon it started and time-slices, before any GPU process of the run
    refused = GpuSharing.for_run(RunConfig(**ONE_STEP_OFF), run_dir)
    refused.probe_command = ("/bin/sh", "-c", "echo 'cudaErrorMpsConnectionFailed: MPS client failed to connect' >&2; exit 1")
    refused.start()
    assert not refused.started and not (pipe / "control").exists() and refused.env("rollout") == {}
    record = refused.record()
    assert (record["mode"], record["requested"], record["daemon"]) == ("timeslice", "auto", "none")
    assert record["reason"].endswith("exited 1: cudaErrorMpsConnectionFailed: MPS client failed to connect")
    # an explicit mps is what the user asked for: no client check, the daemon stays up
    asked = GpuSharing.for_run(RunConfig(gpu_sharing={"mode": "mps"}, **ONE_STEP_OFF), run_dir)
    asked.probe_command = refused.probe_command
    asked.start()
    assert asked.started and (pipe / "control").exists()
    asked.stop()
    # the same run in sync mode: nothing started, the control binary not even called
    sync = GpuSharing.for_run(RunConfig(**GPU_RUN), run_dir)
    sync.start()
    assert not sync.started and sync.record()["reason"].startswith("gpu_sharing.mode=auto: time-sliced, as trainer.mode=sync")
    assert (tmp_path / "calls.log").read_text().count(" -d ") == 3  # auto, auto refused, mps; not sync


def test_auto_time_slices_on_a_gpu_where_mps_was_not_measured_to_pay(control_binary, tmp_path, monkeypatch):
    """auto asks nvidia-smi for the model before any daemon and time-slices on one where MPS was not
    measured (an H100 PCIe: only the SXM H100 80GB HBM3 was)."""
    monkeypatch.setenv("FAKE_GPU_NAME", "NVIDIA H100 PCIe")
    gpu = GpuSharing.for_run(RunConfig(**ONE_STEP_OFF), tmp_path / "run")
    gpu.start()
    record = gpu.record()
    assert (record["mode"], record["requested"], record["daemon"]) == ("timeslice", "auto", "none")
    assert record["reason"].startswith("gpu_sharing.mode=auto: time-sliced, as the GPU is NVIDIA H100 PCIe: "
                                       "MPS was measured to pay only on H200, H100 80GB HBM3")
    assert not (tmp_path / "calls.log").exists()  # the control binary was never asked
    # asked for by name, MPS runs on any GPU
    asked = GpuSharing.for_run(RunConfig(gpu_sharing={"mode": "mps"}, **ONE_STEP_OFF), tmp_path / "run")
    assert asked.plan.action == "start"
    # no nvidia-smi at all: no model, no assumption
    monkeypatch.setenv("PATH", "/nonexistent")
    from services import mps

    monkeypatch.setattr(mps, "DRIVER_BIN_DIRS", ())
    blind = GpuSharing.for_run(RunConfig(**ONE_STEP_OFF), tmp_path / "run")
    assert blind.plan.action == "none" and "no GPU's model could be read" in blind.plan.reason


@pytest.mark.parametrize("cuda_visible, names", [
    (None, ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]),
    ("1", ["NVIDIA H100 80GB HBM3"]),
    ("GPU-a0", ["NVIDIA H200"]),
    ("1,0", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]),
    ("", []),
    ("7", []),
])
def test_visible_gpus_follow_cuda_visible_devices(cuda_visible, names):
    from services.mps import visible_gpus

    rows = [("0", "GPU-a0", "NVIDIA H200"), ("1", "GPU-b1", "NVIDIA H100 80GB HBM3")]
    assert visible_gpus(rows, cuda_visible) == names


@pytest.mark.parametrize("names, pays", [
    (["NVIDIA H200"], True),
    (["NVIDIA H200", "NVIDIA H200"], True),
    (["NVIDIA H100 80GB HBM3"], True),  # -7% at 1x8 on one machine (2026-12-06)
    (["NVIDIA H200", "NVIDIA H100 80GB HBM3"], True),
    (["NVIDIA H100 PCIe"], False),  # another H100, not measured
    (["NVIDIA H200", "NVIDIA A100-SXM4-80GB"], False),  # one unmeasured card is enough to time-slice
    (["NVIDIA GeForce RTX 4090"], False),
    ([], False),
])
def test_auto_takes_mps_only_on_measured_gpus(names, pays):
    from services.mps import unmeasured_gpu_reason

    why = unmeasured_gpu_reason(names)
    assert (why is None) == pays
    if why is not None and names:
        assert any(n in why for n in ("H100 PCIe", "A100", "RTX 4090")) and "NVIDIA H200," not in why


def test_client_check_reports_in_one_line(tmp_path):
    from services.mps import client_fails

    assert client_fails(("/bin/sh", "-c", "exit 0"), str(tmp_path)) is None
    why = client_fails(("/bin/sh", "-c", "echo one >&2; echo 'two: the last' >&2; exit 3"), str(tmp_path))
    assert why == "a CUDA client under it exited 3: two: the last"
    assert client_fails((str(tmp_path / "missing"),), str(tmp_path)).startswith("a CUDA client under it did not come up (")
    assert "TimeoutExpired" in client_fails(("/bin/sh", "-c", "sleep 5"), str(tmp_path), timeout=0.2)


def test_the_replicas_get_the_role_env():
    from rollout.deployment import rollout_app

    from config import ModelConfig, RolloutConfig

    app = rollout_app(ModelConfig(), RolloutConfig(), registry=None, env={"CUDA_MPS_PIPE_DIRECTORY": "/p"})
    env = app._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/p" and env["HF_HUB_OFFLINE"] == "1"


def test_dry_run_shows_the_choice_without_a_daemon():
    from services.mps import preview
    from services.receipt import dry_run_preview

    assert dry_run_preview(RunConfig())["gpu_sharing"] == {
        "requested": "auto", "mode": "timeslice",
        "reason": "gpu_sharing.mode=auto: time-sliced, as rollout.num_gpus=0 (a CPU-only rollout)"}
    pays = RunConfig(**ONE_STEP_OFF)
    assert preview(pays, "/bin/mps-control")["mode"] == "mps"
    assert preview(pays, None)["reason"].endswith("as nvidia-cuda-mps-control is not on this host")
    assert preview(RunConfig(gpu_sharing={"mode": "mps"}, **GPU_RUN), None) == {
        "requested": "mps", "mode": "mps", "reason": "gpu_sharing.mode=mps"}
