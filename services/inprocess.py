"""The orchestrator's Rollout and Learner (services/orchestrator.py protocols) over parts in this
process: one engine instead of the Serve replicas, one PolicyLearner instead of the Ray Train
job. The step loop (run_steps) cannot tell them from the real ones, which is what the benches
(bench/gpu_vs_trl.py: the step with no Ray hop) and the tests that drive it (tests/
test_tree_driver.py) need. The learner answers each command as the Ray worker's rank 0 does
(learner/worker.py init_answer / step_answer / save_answer), handing the payload itself where
the worker leaves it in the object store.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

from learner.protocol import Save, Saved
from learner.policy import PolicyLearner
from learner.types import InitInfo, StepResult, TrainBatch
from learner.worker import init_answer, save_answer, step_answer
from model.adapter import AdapterPayload
from rollout.types import Prompt, Sample, SamplingParams


def _as_is(payload: AdapterPayload) -> AdapterPayload:
    return payload


def cuda_stream(priority: int | None):
    """A CUDA stream of ``priority`` for a part's kernels (lower runs first: -1 is high, 0 the
    default stream's), or None for the thread's current stream. On one GPU in one process, two
    parts on two streams run their kernels side by side in one context, where two processes
    time-slice (issue 34)."""
    if priority is None:
        return None
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"a CUDA stream of priority {priority} was asked for, but this process has no CUDA device")
    low, high = torch.cuda.Stream.priority_range()
    if not high <= priority <= low:
        raise ValueError(f"CUDA stream priority {priority} is outside this device's range [{high}, {low}]")
    return torch.cuda.Stream(priority=priority)


@contextlib.contextmanager
def _on(stream):
    """Run the block's kernels on ``stream``, after everything already queued on the thread's
    current stream (a side stream does not wait for the default stream by itself: the
    generation after a merge must read the merged weights)."""
    if stream is None:
        yield
        return
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield


def _after(stream) -> None:
    """Queue the thread's next kernels after everything on ``stream`` (a merge after the
    generation's last kernels)."""
    if stream is not None:
        import torch

        torch.cuda.current_stream().wait_stream(stream)


class InProcessRollout:
    """generate on an engine of rollout/engines; publish loads the adapter into it, sync checks
    that it holds the version (one engine: nothing to wait for).

    The engine takes one call at a time, as a replica's engine thread does
    (rollout/deployment.py): with one_step_off the loop generates step t+1 in a thread while
    it publishes step t's adapter, and a merge must not write the weights under a generation.
    ``stream_priority``: generate on a CUDA stream of its own (`cuda_stream`)."""

    def __init__(self, engine: Any, stream_priority: int | None = None) -> None:
        self.engine = engine
        self._engine_calls = threading.Lock()
        self._stream = cuda_stream(stream_priority)

    def generate(self, prompts: list[Prompt], params: SamplingParams, version: int) -> list[Sample]:
        with self._engine_calls, _on(self._stream):
            return self.engine.generate(prompts, params, version)

    def publish(self, payload: AdapterPayload) -> None:
        with self._engine_calls:
            _after(self._stream)
            self.engine.load_adapter(payload)

    def sync(self, version: int) -> float:
        if self.engine.loaded_version() != version:
            raise RuntimeError(f"engine holds v{self.engine.loaded_version()}, sync asked v{version}")
        return 0.0


class InProcessLearner:
    """start / step / save_checkpoint on one PolicyLearner. ``run_dir`` is where Init writes
    adapters/init and Save the checkpoints; None keeps no checkpoint (a bench that times steps).
    ``stream_priority``: the step's kernels on a CUDA stream of their own (`cuda_stream`), done
    before the step returns its adapter."""

    def __init__(self, policy: PolicyLearner, run_dir: Path | None, stream_priority: int | None = None) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self._stream = cuda_stream(stream_priority)

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, resume_from: Path | None = None) -> InProcessLearner:
        return cls(PolicyLearner.for_run(cfg, resume_from=resume_from), run_dir)

    def start(self) -> InitInfo:
        if self.run_dir is None:
            raise ValueError("start() writes adapters/init under the run directory: give run_dir")
        return init_answer(self.policy, self.run_dir, _as_is)

    def step(self, batch: TrainBatch) -> StepResult:
        with _on(self._stream):
            result = step_answer(self.policy, batch, _as_is)
        if self._stream is not None:  # the adapter's tensors are written on this stream
            self._stream.synchronize()
        return result

    def save_checkpoint(self, step: int, data_position: dict[str, Any] | None) -> Saved | None:
        if self.run_dir is None:
            return None
        return save_answer(self.policy, Save(step=step, data_position=data_position), self.run_dir)
