"""The adapter in device memory through `counterpoint train` (issue 34, item 3), on the CPU.

configs/smoke.yaml with the transformers engine lending its weights (share_base_weights=true), run
twice with the same seed: adapter_transport=device (the replica maps the learner's two buffers over
shared memory, model/adapter_ipc.py) and adapter_transport=host (today's path). Every sample of
every step carries the version it was asked for, the replica says which way its adapters came, and
the two runs sampled the same tokens with the same log-probs and saved the same adapters: the
transport changes where the bytes travel, not what they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_train_e2e import Budget, start_train, wait_exit

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

STEPS = 3


def rows(run_dir: Path, step: int) -> list[dict]:
    (path,) = (run_dir / f"round_{step}").glob("voice-leading__[0-9]*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(tmp_path: Path, transport: str) -> Path:
    budget = Budget()
    run_dir = tmp_path / "runs" / transport
    run_dir.parent.mkdir(exist_ok=True)
    proc = start_train(run_dir, "--set", "rollout.engine=hf", "--set", "share_base_weights=true",
                       "--set", f"adapter_transport={transport}", "--set", f"trainer.steps={STEPS}",
                       which=transport)
    try:
        wait_exit(proc, budget, run_dir, which=transport)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir


def test_adapters_in_device_memory_sample_what_the_host_path_samples(tmp_path: Path):
    from safetensors.torch import load_file

    from model.adapter_dir import WEIGHTS_FILE

    device, host = run(tmp_path, "device"), run(tmp_path, "host")
    receipts = {d.name: json.loads((d / "run.json").read_text()) for d in (device, host)}
    for name, receipt in receipts.items():
        assert receipt["status"] == "completed", (name, receipt.get("error"))
        assert receipt["adapter_transport"]["mode"] == name, receipt["adapter_transport"]
    for name, d in (("device", device), ("host", host)):  # every step's adapter went the chosen way
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert [m["adapter_in_device_memory"] for m in lines] == [float(name == "device")] * STEPS, name
    for step in range(1, STEPS + 1):
        d, h = rows(device, step), rows(host, step)
        assert d and len(d) == len(h)
        assert {r["adapter_version"] for r in d} == {r["adapter_version"] for r in h} == {step}
        for a, b in zip(d, h):
            assert a["response_token_ids"] == b["response_token_ids"], step
            assert a["response_logprobs"] == b["response_logprobs"], step
    got = load_file(str(device / "adapters" / f"step_{STEPS}" / WEIGHTS_FILE))
    want = load_file(str(host / "adapters" / f"step_{STEPS}" / WEIGHTS_FILE))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
    # The shared base and the adapter buffers are shared-memory files made by the replica and the
    # learner; their cleaner dies with them at Ray's shutdown, so the run removes them
    # (services/launch.py remove_leftover_shared_memory): none of the parts' files is left.
    from services.launch import shared_memory_files, torch_shm_maker

    parts = {part["pid"] for r in receipts.values() for part in r["placement"]["parts"]}
    assert {"rollout", "learner"} <= {part["part"] for part in receipts["device"]["placement"]["parts"]}
    assert all(isinstance(pid, int) for pid in parts), parts
    left = [name for name in shared_memory_files() if torch_shm_maker(name) in parts]
    assert not left, left
