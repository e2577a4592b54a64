"""learner.strategy=fsdp2 on the CPU, with real gloo processes (tests/fsdp_ranks.py, one per rank):
FSDP2 over 2 ranks takes the same step as 1 rank and as DDP over 2 ranks on the same global
batch; its meta-device build loads the same base weights and draws the same adapter as the
plain load; what it publishes and checkpoints has the plain learner's layout, and a resume
continues exactly. Plus the config's one-line refusals.

Tolerance: 1e-4 relative (per tensor, by norm) for gradients and adapters, 2e-6 relative for
the loss. Not exact: the ranks' gradients are summed by a reduce-scatter, in another order and
grouping than one process's sum over micro-batches (DDP over 2 ranks against 1 rank differs by
~1.4e-5 here; one Adam step moves each weight by ~lr, so the adapters differ by as little).
The build's weights, the seeded adapter and the resumed step ARE exact (same bits).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from config import ConfigError, load_config

pytestmark = pytest.mark.slow
RANKS = Path(__file__).with_name("fsdp_ranks.py")
REL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(strategy: str, world: int, out: Path, resume_from: Path | None = None, mode: tuple[str, ...] = (),
              timeout: float = 400) -> dict:
    """Start ``world`` real processes, one gloo rank each; rank 0's result. A rank still running
    after ``timeout`` seconds (waiting in a collective the others never join) fails the test."""
    out.mkdir(parents=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", str(RANKS), *mode, strategy, str(world), str(rank),
                               str(port), str(out), *([str(resume_from)] if resume_from else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [p.communicate()[0][-1500:] for p in procs]
        pytest.fail(f"{strategy} over {world} ranks still running after {timeout:g} s (a hang?): {tails}")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


def rel(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float((got[k] - want[k]).norm() / want[k].norm().clamp(min=1e-30)) for k in want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    out = {"ddp1": run_ranks("ddp", 1, root / "ddp1")}
    ddp_ckpt = root / "ddp1" / "run" / "checkpoints" / "step_1"
    out["fsdp1"] = run_ranks("fsdp2", 1, root / "fsdp1")
    out["fsdp2"] = run_ranks("fsdp2", 2, root / "fsdp2", resume_from=ddp_ckpt)
    out["ddp2"] = run_ranks("ddp", 2, root / "ddp2")
    return out


def test_fsdp2_builds_the_plain_model_and_adapter(runs):
    plain, sharded = runs["ddp1"], runs["fsdp2"]
    # the meta-device build, each rank reading its slices: the plain load's weights, bit for bit
    assert set(sharded["base"]) == set(plain["base"])
    assert all(torch.equal(sharded["base"][k], plain["base"][k]) for k in plain["base"])
    assert all(torch.equal(sharded["buffers"][k], plain["buffers"][k]) for k in plain["buffers"])  # rotary inv_freq
    # the seeded LoRA init: the same draws, the same adapter
    assert all(torch.equal(sharded["init"][k], plain["init"][k]) for k in plain["init"])
    assert any(v.abs().sum() > 0 for k, v in plain["init"].items() if "lora_A" in k)


def test_fsdp2_over_two_ranks_takes_the_step_of_one_rank_and_of_ddp(runs):
    for ref, name in (("ddp1", "fsdp2"), ("fsdp1", "fsdp2"), ("ddp2", "fsdp2"), ("ddp1", "fsdp1")):
        got, want = runs[name], runs[ref]
        assert got["loss1"] == pytest.approx(want["loss1"], rel=2e-6), (name, ref)
        assert got["grad_norm1"] == pytest.approx(want["grad_norm1"], rel=REL), (name, ref)
        assert rel(got["grads"], want["grads"]) < REL, (name, ref)
        assert rel(got["step1"], want["step1"]) < REL, (name, ref)
        assert got["loss2"] == pytest.approx(want["loss2"], rel=2e-6), (name, ref)
        assert rel(got["step2"], want["step2"]) < REL, (name, ref)
    assert any(v.abs().sum() > 0 for k, v in runs["fsdp2"]["grads"].items() if "lora_B" in k)  # it did train


def test_fsdp2_publishes_and_saves_the_plain_layout(runs):
    plain, sharded = runs["ddp1"], runs["fsdp2"]
    published = load_safetensors(sharded["payload1"])
    # the bytes rank 0 published are the adapter gathered from both ranks, exactly
    assert set(published) == set(sharded["step1"])
    assert all(torch.equal(published[k], sharded["step1"][k]) for k in published)
    assert rel(published, load_safetensors(plain["payload1"])) < REL
    assert all(torch.equal(sharded["ckpt_adapter"][k], sharded["step1"][k]) for k in published)
    # the checkpoint's files are the plain learner's (one RNG file per rank more)
    assert [f for f in sharded["ckpt_files"] if f != "rng_rank1.pt"] == plain["ckpt_files"]
    got, want = sharded["ckpt_optimizer"], plain["ckpt_optimizer"]
    assert got["param_groups"] == want["param_groups"] and set(got["state"]) == set(want["state"])
    for i, state in want["state"].items():
        assert got["state"][i]["exp_avg"].shape == state["exp_avg"].shape
        assert torch.equal(got["state"][i]["step"], state["step"])
        # the squared gradients: twice the gradients' relative difference
        assert rel({"v": got["state"][i]["exp_avg_sq"]}, {"v": state["exp_avg_sq"]}) < 2 * REL


def test_fsdp2_resume_continues_exactly_and_reads_a_ddp_checkpoint(runs):
    for name in ("fsdp1", "fsdp2"):
        r = runs[name]
        assert r["resumed_step"] == 1
        assert r["resumed_loss2"] == r["loss2"]
        assert all(torch.equal(r["resumed2"][k], r["step2"][k]) for k in r["step2"])
    # a DDP world-1 checkpoint resumed by FSDP2 over 2 ranks: DDP's own second step, to tolerance
    assert rel(runs["fsdp2"]["other_resumed2"], runs["ddp1"]["step2"]) < REL


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    return {name: run_ranks(strategy, world, root / name, mode=("uneven",), timeout=300)
            for name, strategy, world in (("ddp1", "ddp", 1), ("fsdp1", "fsdp2", 1), ("fsdp2", "fsdp2", 2))}


def test_fsdp2_ranks_with_unequal_micro_batch_counts_take_the_step_of_one_rank(uneven):
    """3 rows over 2 ranks, one row per micro-batch: rank 1 runs a padding micro-batch in each
    of old_log_prob, ref and both update epochs (learner/passes.py pad_micro_batches); the step
    is the one rank's (plain and fsdp2) to the tolerance above. (DDP over 2 ranks, padded the
    same way: tests/test_learner_ddp_uneven.py.)"""
    for ref in ("ddp1", "fsdp1"):
        got, want = uneven["fsdp2"], uneven[ref]
        assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=2e-6), ref
        for key in ("grad_norm", "kl", "entropy", "clip_frac", "ratio", "ppl_ratio", "rollout_kl", "pg_loss"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=REL, abs=1e-9), (ref, key)
        assert got["metrics"]["sequences"] == want["metrics"]["sequences"] == 3.0
        assert got["metrics"]["response_tokens"] == want["metrics"]["response_tokens"] == 16.0
        assert rel(got["grads"], want["grads"]) < REL, ref
        assert rel(got["step1"], want["step1"]) < REL, ref
    assert uneven["ddp1"]["metrics"]["kl"] > 0  # the ref pass ran: beta > 0 on an adapter that moved
    assert any(v.abs().sum() > 0 for k, v in uneven["fsdp2"]["grads"].items() if "lora_B" in k)


@pytest.mark.parametrize("sets, message", [
    (["learner.deepspeed=true"], "learner.deepspeed is now learner.strategy (ddp | deepspeed | fsdp2)"),
    (["learner.deepspeed=false"], "learner.deepspeed is now learner.strategy"),
    (["learner.strategy=fsdp3"], "learner.strategy"),
    (["learner.strategy=fsdp2", "learner.cuda_graphs=true"], "learner.cuda_graphs=true with learner.strategy=fsdp2"),
    (["learner.strategy=fsdp2", "learner.share_prompt_prefix=true"],
     "learner.share_prompt_prefix=true with learner.strategy=fsdp2"),
    (["learner.fsdp_cpu_offload=true"], "learner.fsdp_cpu_offload=true needs learner.strategy=fsdp2"),
    (["learner.strategy=fsdp2", "learner.fsdp_cpu_offload=true"], "needs learner.strategy=fsdp2 and learner.use_gpu=true"),
    (["learner.strategy=fsdp2", "rollout.engine=hf", "share_base_weights=true"],
     "share_base_weights=true, but learner.strategy=fsdp2 shards its own copy of the base weights"),
])
def test_what_fsdp2_cannot_serve_is_refused_in_one_line(sets, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert "\n" not in str(err.value) and message in str(err.value)


def test_ddp_stays_the_default_and_fsdp2_on_the_cpu_is_accepted():
    assert load_config(None, []).learner.strategy == "ddp"
    cfg = load_config(None, ["learner.strategy=fsdp2", "learner.workers=2"])
    assert cfg.learner.strategy == "fsdp2" and cfg.shares_base_weights()[0] is False
