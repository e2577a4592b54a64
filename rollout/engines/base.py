"""One engine interface: the caller never knows whether vLLM or transformers samples.

Data plane: `generate`. Control plane: `load_adapter` / `loaded_version`. Both engines render
prompts to token ids the same way (`tokenize_prompt`), stop on the same token set
(`model.base.stop_token_ids`), and return log-probs of the sampling distribution (after
temperature), so their outputs are interchangeable and comparable to the learner's recompute.

Version semantics: version 0 is the base model; version v >= 1 is the adapter published as v.
An engine holds at most one adapter. `generate(..., adapter_version=v)` answers with exactly v or
raises `AdapterVersionError`; it never substitutes another version.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from model.base import StopTokens
from model.adapter import AdapterPayload
from rollout.types import Prompt, Sample, SamplingParams

log = logging.getLogger(__name__)


class AdapterVersionError(RuntimeError):
    """The requested adapter version is not the one this engine holds."""


def tokenize_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Chat template with the generation prompt, then the forced assistant prefix, as token ids.

    Rendering to text and tokenizing once (rather than letting each engine template) is what
    makes vLLM and transformers see identical prompt tokens.
    """
    if not prompt.messages:
        raise ValueError("a prompt needs at least one message")
    text = tokenizer.apply_chat_template(
        list(prompt.messages), add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text + prompt.assistant_prefix, add_special_tokens=False)["input_ids"])


def finish_reason(token_ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    return "stop" if token_ids and token_ids[-1] in set(stop_ids) else "length"


def check_lengths(prompt_ids: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    longest = max((len(p) for p in prompt_ids), default=0)
    if longest + max_tokens > max_model_len:
        raise ValueError(
            f"prompt of {longest} tokens + max_tokens {max_tokens} exceeds rollout.max_model_len "
            f"{max_model_len}"
        )


class Engine(ABC):
    """A loaded base model that samples completions, optionally through one LoRA adapter."""

    kind: str
    model_dir: Path
    stop: StopTokens

    @abstractmethod
    def generate(
        self, prompts: list[Prompt], params: SamplingParams, adapter_version: int
    ) -> list[Sample]:
        """`params.n` samples per prompt, ordered by (prompt_index, sample_index)."""

    @abstractmethod
    def load_adapter(self, payload: AdapterPayload) -> None:
        """Make `payload.version` the adapter this engine samples with; drops the previous one."""

    @abstractmethod
    def loaded_version(self) -> int:
        """The adapter version held (0 = none)."""

    def load_device_payload(self, payload, importer) -> None:
        """Make a device payload's version (model/adapter_ipc.py DeviceAdapterPayload) the adapter
        this engine samples with. Here the replica's own process copies the learner's buffer and
        checks it (``importer``: its DeviceImporter, which keeps each buffer mapped), then loads
        the copy; an engine whose model lives in another process (vLLM's worker) overrides this
        to have that process open the buffer. TransportRefused or AdapterChecksumError when the
        bytes cannot be had or are not the adapter the learner described."""
        self.load_device_adapter(importer.open(payload))

    def load_device_adapter(self, imported) -> None:
        """Make ``imported`` (model/adapter_ipc.py ImportedAdapter: the learner's adapter copied
        from its device buffer and checked) the adapter this engine samples with. Engines that load
        adapters from files take the host path's bytes; one that can take the tensors as views of
        the copy (``imported.tensors()``) overrides this."""
        self.load_adapter(imported.payload())

    def export_base(self):
        """Handles to the engine's base weights for a learner on the same device
        (model/shared_base.py BaseExport); ShareRefused where the engine cannot lend them."""
        from model.shared_base import ShareRefused

        raise ShareRefused(f"the {self.kind} engine cannot lend its base weights (the vllm engine on a GPU "
                           "and the hf engine can)")

    def close(self) -> None:
        """Release what the engine keeps outside its process's memory (files); idempotent."""

    def stats(self) -> dict:
        """Engine counters for the receipt, e.g. a compiled engine's compile/capture seconds per
        batch bucket, kept apart from the step times they fall into. {} when it keeps none."""
        return {}

    def prepare(
        self, prompts: Sequence[Prompt], params: SamplingParams, adapter_version: int
    ) -> tuple[list[list[int]], tuple[int, ...]]:
        """What every engine checks and renders before sampling: (prompt token ids, stop ids)."""
        if params.temperature <= 0:
            raise ValueError("temperature must be > 0 (sampling; log-probs are of the sampling distribution)")
        self.check_version(adapter_version)
        prompt_ids = [tokenize_prompt(self.tokenizer, p) for p in prompts]
        check_lengths(prompt_ids, params.max_tokens, self.rollout_cfg.max_model_len)
        return prompt_ids, self.stop_ids(params)

    def check_version(self, adapter_version: int) -> None:
        held = self.loaded_version()
        if adapter_version != 0 and adapter_version != held:
            raise AdapterVersionError(
                f"{self.kind} engine holds adapter v{held}; request needs v{adapter_version} "
                "(load it first)"
            )

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        return tuple(dict.fromkeys([*self.stop.ids, *params.stop_token_ids]))

    def log_stop_tokens(self) -> None:
        if self.stop.warning:
            log.warning("%s engine, %s: %s", self.kind, self.model_dir, self.stop.warning)
        log.info("%s engine stop tokens: %s", self.kind, list(self.stop.ids))
