"""The in-process parts (services/inprocess.py) under the driver's own step loop: with
one_step_off the loop generates step t+1 in a thread while it publishes step t's adapter, and
the in-process rollout must then take one engine call at a time, as a replica's engine thread
does (a merge must never write the weights under a generation). A real HF engine on
configs/smoke.yaml's tiny model, a real learner, the voice-leading grader over gRPC on 127.0.0.1.
"""

from __future__ import annotations

import time

import pytest

from config import load_config
from graders.client import GraderClient
from graders.service import GraderCore, start_server
from graders.tasks import make_task
from learner.policy import PolicyLearner
from model.base import resolve_model
from rollout.engines.hf import HFEngine
from services.inprocess import InProcessLearner, InProcessRollout, cuda_stream
from services.orchestrator import RunParts, run_steps
from services.sampler import sampler_from_config


class CallLog:
    """Wraps a real engine and records when each of its generate and load_adapter calls ran."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[str, float, float]] = []  # appended from two threads: list.append is atomic

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _timed(self, name, fn, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.calls.append((name, t0, time.monotonic()))

    def generate(self, prompts, params, version):
        return self._timed("generate", self.engine.generate, prompts, params, version)

    def load_adapter(self, payload):
        # a load that takes a while, as a merge into a big model does: a generation started
        # meanwhile would overlap it unless the rollout holds it back
        def slow_load(p):
            time.sleep(0.3)
            return self.engine.load_adapter(p)

        return self._timed("load_adapter", slow_load, payload)


def overlapping(calls: list[tuple[str, float, float]]) -> list[tuple[str, str]]:
    spans = sorted(calls, key=lambda c: c[1])
    return [(a[0], b[0]) for a, b in zip(spans, spans[1:]) if b[1] < a[2]]


def test_overlapping_finds_a_call_that_began_before_the_previous_ended():
    assert overlapping([("generate", 0.0, 2.0), ("load_adapter", 1.0, 1.5)]) == [("generate", "load_adapter")]
    assert overlapping([("generate", 0.0, 1.0), ("load_adapter", 1.0, 1.5), ("generate", 1.6, 2.0)]) == []


@pytest.mark.slow  # a model and an engine
def test_one_step_off_in_process_never_loads_an_adapter_under_a_generation(tmp_path):
    cfg = load_config("configs/smoke.yaml", [
        "rollout.engine=hf", "rollout.max_tokens=48", "trainer.mode=one_step_off", "trainer.steps=4",
        "trainer.prompts_per_step=1", "trainer.group_size=2", "trainer.save_every=0", "learner.beta=0",
        f"trainer.runs_dir={tmp_path}"])
    server = start_server(GraderCore(make_task(cfg.grader)), "127.0.0.1", 0)
    try:
        with GraderClient(server.address, max_retries=0) as grader:
            cases = {c.id: c for c in grader.cases(limit=cfg.trainer.limit or 0, split="train")}
            engine = CallLog(HFEngine(resolve_model(cfg.model), cfg.model, cfg.rollout))
            policy = PolicyLearner.for_run(cfg)
            rollout = InProcessRollout(engine)
            first = policy.payload(1)
            rollout.publish(first)
            records = []
            parts = RunParts(cfg=cfg, cases=cases, sampler=sampler_from_config(list(cases), cfg.trainer, cfg.seed),
                             grader=grader, rollout=rollout, learner=InProcessLearner(policy, run_dir=None),
                             record=records.append, version=first.version)
            run_steps(parts, 1)
    finally:
        server.stop(None)
    assert [r.step for r in records] == [1, 2, 3, 4]
    # the pipeline was full: steps 2.. trained on samples of the adapter one version back
    assert [r.extra["adapter_staleness"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert [name for name, *_ in engine.calls].count("load_adapter") == 5  # the first, then one per step
    assert overlapping(engine.calls) == []


def test_a_cuda_stream_needs_a_cuda_device():
    import torch

    assert cuda_stream(None) is None
    if torch.cuda.is_available():
        assert cuda_stream(-1).priority == -1
    else:
        with pytest.raises(ValueError, match="a CUDA stream of priority -1 was asked for, but this process has no CUDA "
                                             "device"):
            cuda_stream(-1)
