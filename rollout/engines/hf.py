"""The transformers engine: `generate` with sampling, peft for the adapter.

The fallback where vLLM is not installed (and the GPU path on hosts vLLM cannot reach). Its
log-probs come from `output_scores`: the logits after the sampling processors (temperature,
top-k, top-p), so log_softmax of them is the sampling distribution — what vLLM's
`processed_logprobs` returns.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers.generation.logits_process import LogitsProcessor

from model.adapter_dir import WEIGHTS_FILE, check_adapter_fits, validate_payload, write_payload
from config.rollout import ModelConfig, RolloutConfig
from model.base import load_causal_lm
from rollout.engines.base import Engine, finish_reason
from model.base import stop_token_ids
from model.adapter import AdapterMismatch, AdapterPayload
from rollout.types import Prompt, Sample, SamplingParams



def use_fast_path(rollout_cfg: RolloutConfig) -> bool:
    """The hf engine on a GPU runs rollout/engines/hf_fast.py (plain `generate` there is 4-9x
    slower: bench/results/gpu-engine.md); on CPU this class, unchanged."""
    return rollout_cfg.num_gpus > 0 and torch.cuda.is_available()


class HFEngine(Engine):
    kind = "hf"

    def __init__(self, model_dir: Path, model_cfg: ModelConfig, rollout_cfg: RolloutConfig):
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.rollout_cfg = rollout_cfg
        self.device = "cuda" if rollout_cfg.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = load_causal_lm(model_dir, model_cfg).to(self.device)
        self.model.eval()
        self.stop = stop_token_ids(model_dir, model_cfg.eos_token_ids, tokenizer=self.tokenizer)
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.stop.ids[0]
        )
        self._version = 0
        self.log_stop_tokens()

    # ----------------------------------------------------------------- control plane

    def loaded_version(self) -> int:
        return self._version

    def load_adapter(self, payload: AdapterPayload) -> None:
        from peft import PeftModel

        validate_payload(payload)
        # peft reads adapters from a directory only; it holds the weights once loaded, so the
        # files go at once: kept until the next version, a replica that dies (SIGKILL, a test
        # killing it) left its last one in /tmp.
        new_dir = write_payload(payload, tempfile.mkdtemp(prefix=f"cp-hf-adapter-v{payload.version}-"))
        try:
            base = self.model.unload() if isinstance(self.model, PeftModel) else self.model
            loaded = PeftModel.from_pretrained(base, str(new_dir), is_trainable=False)
            try:
                check_adapter_fits(loaded, Path(new_dir) / WEIGHTS_FILE, f"adapter v{payload.version}")
            except AdapterMismatch:  # the bare base, claiming no version it does not hold
                self.model, self._version = loaded.unload(), 0
                raise
            self.model = loaded.to(self.device)
        finally:
            shutil.rmtree(new_dir, ignore_errors=True)
        self.model.eval()
        self._version = payload.version

    def export_base(self):
        """Handles to the base weights for a learner beside this engine (model/shared_base.py).
        They never change: adapters are peft layers on top, not merged, so no fence is needed."""
        from peft import PeftModel

        from model.shared_base import export_base

        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        named = [(name.replace(".base_layer.", "."), p) for name, p in base.named_parameters()
                 if ".lora_" not in name]
        return export_base("hf", named, {}, None)

    # ----------------------------------------------------------------- data plane

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], params: SamplingParams, adapter_version: int
    ) -> list[Sample]:
        from transformers import GenerationConfig, LogitsProcessorList
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if not prompts:
            return []
        prompt_ids, stop_ids = self.prepare(prompts, params, adapter_version)

        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, p in enumerate(prompt_ids):  # left padding: every row ends where generation starts
            ids[b, width - len(p) :] = torch.tensor(p)
            attn[b, width - len(p) :] = 1
        # Sampling warpers are passed as our own processors, in vLLM's order, followed by a
        # recorder that sees the final (processed) scores; the config's own warpers are set to
        # their neutral values so that none is added behind the recorder (transformers appends
        # its warpers after custom processors) and none comes from the model's defaults.
        recorder = _SampledLogprobRecorder()
        processors = LogitsProcessorList()
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        processors.append(recorder)
        gen_cfg = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.n,
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_id,
            stop_strings=list(params.stop) or None,
        )
        if params.seed is not None:
            torch.manual_seed(params.seed)
        inputs = {"input_ids": ids.to(self.device), "attention_mask": attn.to(self.device)}
        if params.stop:  # transformers matches stop strings through the tokenizer
            inputs["tokenizer"] = self.tokenizer
        if adapter_version == 0 and self._version != 0:
            with self.model.disable_adapter():
                sequences = self.model.generate(**inputs, generation_config=gen_cfg, logits_processor=processors)
        else:
            sequences = self.model.generate(**inputs, generation_config=gen_cfg, logits_processor=processors)
        new_tokens = sequences[:, width:].cpu()
        logprobs = recorder.finish(new_tokens)

        stop_set = set(stop_ids)
        samples: list[Sample] = []
        for row in range(new_tokens.shape[0]):
            prompt_index, sample_index = divmod(row, params.n)
            toks = new_tokens[row].tolist()
            cut = next((i + 1 for i, t in enumerate(toks) if t in stop_set), len(toks))
            if params.stop:  # a row ended by a stop string is padded after it: cut there
                cut = next((i + 1 for i in range(cut) if any(
                    s in self.tokenizer.decode(toks[: i + 1], skip_special_tokens=True) for s in params.stop)), cut)
            toks = toks[:cut]
            samples.append(
                Sample(
                    prompt_index=prompt_index,
                    sample_index=sample_index,
                    text=self.tokenizer.decode(toks, skip_special_tokens=True),
                    prompt_token_ids=list(prompt_ids[prompt_index]),
                    token_ids=toks,
                    logprobs=logprobs[row, :cut].tolist(),
                    finish_reason=finish_reason(toks, stop_ids),
                    adapter_version=adapter_version,
                )
            )
        return samples


class _SampledLogprobRecorder(LogitsProcessor):
    """A logits processor that keeps log p(sampled token) under the processed distribution.

    At step t it holds log_softmax(scores_t) for one step only ([rows, V]) and, at step t+1,
    reads the token sampled at t from input_ids: memory O(rows x V), not O(rows x T x V) as
    `output_scores` would be.
    """

    def __init__(self) -> None:
        self._prev: torch.Tensor | None = None
        self._cols: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:
            self._cols.append(self._prev.gather(-1, input_ids[:, -1:]).squeeze(-1).cpu())
        self._prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, T] log-probs aligned with `new_tokens` (the generated part of the sequences)."""
        if self._prev is not None:
            last = new_tokens[:, len(self._cols) : len(self._cols) + 1].to(self._prev.device)
            self._cols.append(self._prev.gather(-1, last).squeeze(-1).cpu())
            self._prev = None
        return torch.stack(self._cols, dim=1)
