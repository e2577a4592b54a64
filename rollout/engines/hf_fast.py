"""The transformers engine's fast path: a static KV cache and a decode step captured once per
shape bucket (a CUDA graph), with the LoRA adapter loaded straight from the payload's tensors.

Why not `generate` (bench/results/gpu-engine.md, H200, Qwen3 shapes, batch 8): plain
`generate` costs 25-30 ms per decode step, its static cache + compile 4.2 ms (0.6B), its
`generate_batch` 72 ms. Plain `generate` launches every kernel from Python; the compiled one
still runs transformers' per-token loop (logits processors, stopping criteria, a host sync per
token) around the compiled forward. Here one decode step - forward,
temperature/top-k/top-p, sampling, the sampled token's log-prob, stop detection, writing the
outputs - is one graph replay (2.8 ms at 0.6B, 6.2 ms at 4B with `hf_decode="inductor"`); the
host looks at the stop flags every `SYNC_EVERY` steps only.

Buckets: rows are padded up to a batch bucket (`rollout.hf_batch_buckets`) and the cache length
up to a multiple of `CACHE_LEN_STEP`; one graph per (batch, cache length, top-k, top-p on,
stop-set size), captured at first use and reused by every later step (`stats()["capture_s"]`
is that one-off cost, kept apart from generation time).

Adapters (`rollout.hf_lora`): "merged" writes W0 + scale * B @ A (computed in float32, rounded
once) into the model's own weights, keeping W0 in a copy of the adapted layers; "unmerged" adds
scale * B(A x) to each adapted layer's output (float32, as peft does) through static buffers the
graph reads. Either way the payload's tensors go straight to the device: no temp dir, no peft.
Version semantics are the base Engine's: a request names its version and gets exactly it.

Log-probs are of the processed (sampling) distribution, like the other engines. Left-padded
rows get position ids counted from their first real token, as the learner's right-padded
recompute does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model.adapter_dir import AdapterError
from rollout.engines.lora_weights import LoraTensors, merged_weight, parse_adapter
from rollout.engines.base import Engine, finish_reason
from model.adapter import AdapterPayload
from rollout.types import Prompt, Sample, SamplingParams

if TYPE_CHECKING:
    from config.rollout import ModelConfig, RolloutConfig
    from model.base import StopTokens

log = logging.getLogger(__name__)

CACHE_LEN_STEP = 256  # cache lengths are rounded up to this: attention reads the whole cache
SYNC_EVERY = 16  # decode steps between host checks of "every row stopped"


# --------------------------------------------------------------------------- pure helpers


def batch_bucket(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``rows`` (rows above the largest bucket are split by
    ``split_rows`` first)."""
    if rows < 1:
        raise ValueError(f"need at least one row, got {rows}")
    for b in sorted(buckets):
        if b >= rows:
            return b
    raise ValueError(f"{rows} rows exceed the largest batch bucket {max(buckets)}")


def split_rows(rows: int, buckets: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) chunks of at most the largest bucket each."""
    top = max(buckets)
    return [(lo, min(lo + top, rows)) for lo in range(0, rows, top)]


def cache_len(prompt_width: int, max_tokens: int, max_model_len: int, step: int = CACHE_LEN_STEP) -> int:
    """Slots a batch needs (prompt + max_tokens - 1 decode inputs), rounded up to ``step`` and
    capped at ``max_model_len`` (which the request was already checked against)."""
    need = prompt_width + max_tokens
    return min(-(-need // step) * step, max(max_model_len, need))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: torch.Tensor | None) -> torch.Tensor:
    """Processed logits (float32), in vLLM's and the hf engine's order: temperature, top-k, top-p
    (top-p as transformers' TopPLogitsWarper: drop the tokens whose ascending cumulative mass is
    <= 1 - top_p, keeping at least one). Shape-static: capturable in a CUDA graph."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: int,
                  top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] long, its log-prob [B] float32) sampled from the processed distribution:
    argmax(log p - log E), E ~ Exp(1), is a draw from p with no host sync (graph-safe)."""
    logp = torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    noise = torch.empty_like(logp).exponential_()
    tok = torch.argmax(logp - noise.log(), dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


# --------------------------------------------------------------------------- the static cache


class StaticKV:
    """A KV cache the model's attention layers write through ``update``: per layer a [B, H, L, D]
    key and value buffer at fixed addresses; ``write_pos`` (a long tensor of slots) says where
    this forward's keys go. Positions are ours (passed in), so nothing here syncs the host."""

    is_compileable = True

    def __init__(self, model_config, batch: int, length: int, dtype: torch.dtype, device):
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (batch, heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.length = length
        self.write_pos: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write_pos, key_states)
        v.index_copy_(2, self.write_pos, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Some transformers versions ask this to build cache_position when none is passed; we
        # always pass cache_position and position_ids, and a host-side int never syncs.
        return 0


# --------------------------------------------------------------------------- adapters


class AdapterSlot:
    """The adapter the model generates with, merged or unmerged (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, mode: str):
        if mode not in ("merged", "unmerged"):
            raise ValueError(f"rollout.hf_lora must be 'merged' or 'unmerged', got {mode!r}")
        self.model, self.mode = model, mode
        self.lora: dict[str, LoraTensors] = {}
        self.base: dict[str, torch.Tensor] = {}  # merged: W0 of adapted layers
        self.in_weights = 0  # merged: the version now written into the weights (0 = W0)
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # unmerged
        self.enabled = None  # unmerged: 0-d float tensor, 1 = adapter on, 0 = base model
        self._hooks: list = []
        self.layout: tuple | None = None  # (name, r, in, out) of every adapted layer

    def _linear(self, name: str) -> torch.nn.Linear:
        try:
            mod = self.model.get_submodule(name)
        except AttributeError:
            mod = None
        if not isinstance(mod, torch.nn.Linear):
            raise AdapterError(f"adapter names {name!r}, which is not a linear layer of the model")
        return mod

    def load(self, lora: dict[str, LoraTensors], version: int) -> bool:
        """Hold ``lora`` as ``version``. True when the layout (layers, ranks) changed, i.e.
        captured graphs that read adapter buffers must be captured again."""
        for name, t in lora.items():
            lin = self._linear(name)
            if tuple(t.a.shape[1:]) != (lin.in_features,) or t.b.shape[0] != lin.out_features:
                raise AdapterError(f"adapter v{version}: {name} A {tuple(t.a.shape)} B {tuple(t.b.shape)} do not fit "
                                   f"a {lin.in_features}->{lin.out_features} layer")
        layout = tuple(sorted((n, t.a.shape[0]) for n, t in lora.items()))
        changed = layout != self.layout
        if self.mode == "merged":
            self._restore()
            for name in lora:
                if name not in self.base:
                    self.base[name] = self._linear(name).weight.detach().clone()
            self.lora = lora
            self._merge(version)
        else:
            if changed:
                self._install(lora)
            for name, t in lora.items():
                a, b, s = self.buffers[name]
                a.copy_(t.a), b.copy_(t.b), s.fill_(t.scale)
            self.lora = lora
        self.layout = layout
        return changed

    @torch.no_grad()
    def _merge(self, version: int) -> None:
        for name, t in self.lora.items():
            w = self._linear(name).weight
            w.copy_(merged_weight(self.base[name], t))
        self.in_weights = version

    @torch.no_grad()
    def _restore(self) -> None:
        for name in self.lora:
            self._linear(name).weight.copy_(self.base[name])
        self.in_weights = 0

    def _install(self, lora: dict[str, LoraTensors]) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.buffers = [], {}
        dev = next(self.model.parameters()).device
        self.enabled = torch.ones((), device=dev)
        for name, t in lora.items():
            bufs = (torch.zeros_like(t.a, device=dev), torch.zeros_like(t.b, device=dev),
                    torch.zeros((), device=dev))
            self.buffers[name] = bufs
            self._hooks.append(self._linear(name).register_forward_hook(_lora_hook(*bufs, self.enabled)))

    def use(self, version: int, held: int) -> None:
        """Make the weights answer for ``version`` (0 = base, else the held adapter)."""
        if self.mode == "merged":
            if version == 0 and self.in_weights != 0:
                self._restore()
            elif version != 0 and self.in_weights != version:
                self._merge(held)
        elif self.enabled is not None:
            self.enabled.fill_(0.0 if version == 0 else 1.0)


def _lora_hook(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, enabled: torch.Tensor):
    def hook(module, args, out):
        x = args[0]
        delta = (x.to(a.dtype) @ a.t()) @ b.t()
        return (out + delta * (scale * enabled)).to(out.dtype)  # peft: base + lora in float32, then cast

    return hook


# --------------------------------------------------------------------------- the decoder


@dataclass
class _Batch:
    """Static buffers of one (batch, cache length, sampling shape) bucket and its graph."""

    cache: StaticKV
    arange: torch.Tensor  # [L]
    pad_len: torch.Tensor  # [B]
    pos: torch.Tensor  # [1] slot of the token being fed
    step: torch.Tensor  # [1] output column being written
    cur: torch.Tensor  # [B] token fed at this step
    done: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # 0-d
    top_p: torch.Tensor  # 0-d
    stop: torch.Tensor  # [S]
    out_tok: torch.Tensor  # [B, L]
    out_lp: torch.Tensor  # [B, L]
    graph: Any = None


class FastDecoder:
    """Batched sampling on a loaded causal LM with a static cache; graphs on CUDA, eager elsewhere
    (the same step function, so CPU tests check the logic the graphs run)."""

    def __init__(self, model, pad_id: int, buckets: Sequence[int], max_model_len: int,
                 capture: str = "graph", cache_len_step: int = CACHE_LEN_STEP):
        if capture not in ("graph", "inductor", "eager"):
            raise ValueError(f"rollout.hf_decode must be graph, inductor or eager, got {capture!r}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"rollout.hf_batch_buckets must be positive sizes, got {list(buckets)}")
        self.model, self.pad_id = model, pad_id
        self.buckets, self.max_model_len, self.cache_len_step = sorted(set(buckets)), max_model_len, cache_len_step
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.capture = capture if self.device.type == "cuda" else "eager"
        self.batches: dict[tuple, _Batch] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture != "eager" else None
        self.step_fn = self._step
        if self.capture == "inductor":
            import torch._dynamo.config as dynamo_config

            # one compile per bucket shape; dynamo's default limit (8) would drop later buckets to eager
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
            self.step_fn = torch.compile(self._step, fullgraph=True, dynamic=False)
        self.stats: dict[str, Any] = {"capture_s": {}, "decode_steps": 0, "decode_s": 0.0, "prefill_s": 0.0}
        self.min_value = torch.finfo(self.dtype).min

    def reset_graphs(self) -> None:
        """Forget captured graphs (the adapter layout changed under them)."""
        self.batches.clear()

    # --- one decode step: reads/writes only the bucket's static buffers
    def _step(self, s: _Batch, top_k: int, use_top_p: bool) -> None:
        allowed = (s.arange[None, :] >= s.pad_len[:, None]) & (s.arange[None, :] <= s.pos)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, self.min_value)
        position_ids = (s.pos - s.pad_len)[:, None]
        s.cache.write_pos = s.pos
        logits = self.model(input_ids=s.cur[:, None], attention_mask=mask[:, None, None, :], position_ids=position_ids,
                            past_key_values=s.cache, use_cache=True, logits_to_keep=1, cache_position=s.pos).logits[:, -1]
        tok, lp = sample_tokens(logits, s.temperature, top_k, s.top_p if use_top_p else None)
        tok = torch.where(s.done, torch.full_like(tok, self.pad_id), tok)
        lp = torch.where(s.done, torch.zeros_like(lp), lp)
        s.out_tok.index_copy_(1, s.step, tok[:, None])
        s.out_lp.index_copy_(1, s.step, lp[:, None])
        s.done.logical_or_(((tok[:, None] == s.stop[None, :]).any(-1)))
        s.cur.copy_(tok)
        s.pos.add_(1)
        s.step.add_(1)

    def _bucket(self, rows: int, length: int, top_k: int, use_top_p: bool, n_stop: int) -> _Batch:
        key = (rows, length, top_k, use_top_p, n_stop)
        if key in self.batches:
            return self.batches[key]
        dev = self.device
        s = _Batch(
            cache=StaticKV(self.model.config, rows, length, self.dtype, dev),
            arange=torch.arange(length, device=dev), pad_len=torch.zeros(rows, dtype=torch.long, device=dev),
            pos=torch.zeros(1, dtype=torch.long, device=dev), step=torch.zeros(1, dtype=torch.long, device=dev),
            cur=torch.full((rows,), self.pad_id, dtype=torch.long, device=dev),
            done=torch.zeros(rows, dtype=torch.bool, device=dev),
            temperature=torch.ones((), device=dev), top_p=torch.ones((), device=dev),
            stop=torch.full((n_stop,), -1, dtype=torch.long, device=dev),
            out_tok=torch.full((rows, length), self.pad_id, dtype=torch.long, device=dev),
            out_lp=torch.zeros((rows, length), device=dev),
        )
        if self.capture != "eager":
            t0 = time.perf_counter()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up (and, for inductor, the compile) outside the capture
                    s.pos.zero_(), s.step.zero_()
                    self.step_fn(s, top_k, use_top_p)
            torch.cuda.current_stream().wait_stream(stream)
            s.pos.zero_(), s.step.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.step_fn(s, top_k, use_top_p)
            torch.cuda.synchronize()
            s.graph = graph
            self.stats["capture_s"][f"b{rows}xL{length}"] = round(time.perf_counter() - t0, 3)
        self.batches[key] = s
        return s

    @torch.no_grad()
    def decode(self, prompt_ids: list[list[int]], max_tokens: int, temperature: float, top_k: int,
               top_p: float, stop_ids: Sequence[int], seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one completion per row: ([rows, max_tokens] tokens, pad after a stop token;
        [rows, max_tokens] log-probs) on the CPU."""
        if seed is not None:
            torch.manual_seed(seed)
        toks, lps = [], []
        for lo, hi in split_rows(len(prompt_ids), self.buckets):
            t, lp = self._decode_chunk(prompt_ids[lo:hi], max_tokens, temperature, top_k, top_p, stop_ids)
            toks.append(t), lps.append(lp)
        return torch.cat(toks), torch.cat(lps)

    def _decode_chunk(self, prompt_ids, max_tokens, temperature, top_k, top_p, stop_ids):
        rows = len(prompt_ids)
        bucket = batch_bucket(rows, self.buckets)
        width = max(len(p) for p in prompt_ids)
        length = cache_len(width, max_tokens, self.max_model_len, self.cache_len_step)
        use_top_p = top_p < 1.0
        s = self._bucket(bucket, length, top_k if top_k > 0 else 0, use_top_p, len(stop_ids))
        dev = self.device
        padded = list(prompt_ids) + [prompt_ids[0]] * (bucket - rows)  # filler rows, dropped below
        ids = torch.full((bucket, width), self.pad_id, dtype=torch.long)
        pad_len = torch.tensor([width - len(p) for p in padded])
        for b, p in enumerate(padded):
            ids[b, width - len(p):] = torch.tensor(p)
        ids, pad_len = ids.to(dev), pad_len.to(dev)
        s.pad_len.copy_(pad_len)
        s.temperature.fill_(temperature), s.top_p.fill_(top_p)
        s.stop.copy_(torch.tensor(list(stop_ids), dtype=torch.long))
        s.done.zero_()
        t0 = time.perf_counter()
        # prefill (eager: its width changes every call), then the first sampled token
        q = torch.arange(width, device=dev)
        allowed = (s.arange[None, None, :] <= q[None, :, None]) & (
            (s.arange[None, None, :] >= pad_len[:, None, None]) | (s.arange[None, None, :] == q[None, :, None]))
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill(~allowed, self.min_value)
        s.cache.write_pos = q
        logits = self.model(input_ids=ids, attention_mask=mask[:, None], position_ids=(q[None, :] - pad_len[:, None]).clamp(min=0),
                            past_key_values=s.cache, use_cache=True, logits_to_keep=1, cache_position=q).logits[:, -1]
        tok, lp = sample_tokens(logits, s.temperature, s_top_k(top_k), s.top_p if use_top_p else None)
        s.out_tok.fill_(self.pad_id), s.out_lp.zero_()
        s.out_tok[:, 0], s.out_lp[:, 0] = tok, lp
        s.done.copy_((tok[:, None] == s.stop[None, :]).any(-1))
        s.cur.copy_(tok)
        s.pos.fill_(width), s.step.fill_(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        steps = 0
        for i in range(1, max_tokens):
            if s.graph is not None:
                s.graph.replay()
            else:
                self.step_fn(s, s_top_k(top_k), use_top_p)
            steps += 1
            if i % SYNC_EVERY == 0 and bool(s.done[:rows].all()):
                break
        out_tok, out_lp = s.out_tok[:rows, :max_tokens].cpu(), s.out_lp[:rows, :max_tokens].cpu()
        t2 = time.perf_counter()
        self.stats["prefill_s"] += t1 - t0
        self.stats["decode_s"] += t2 - t1
        self.stats["decode_steps"] += steps
        return out_tok, out_lp


def stop_string_cut(tokenizer, tokens: list[int], stops: Sequence[str]) -> int | None:
    """Length of the shortest prefix of ``tokens`` whose text holds one of ``stops`` (the token
    that completes the string is kept, as the other engines keep it), None when none does.
    Binary search: a prefix's text only grows as tokens are added."""
    def holds(n: int) -> bool:
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not tokens or not holds(len(tokens)):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return lo


def s_top_k(top_k: int) -> int:
    return top_k if top_k > 0 else 0


# --------------------------------------------------------------------------- the engine


class HFFastEngine(Engine):
    """The `hf` engine on CUDA (make_engine picks it there); runs eager on CPU for tests."""

    kind = "hf"

    def __init__(self, model_dir: Path, model_cfg: "ModelConfig", rollout_cfg: "RolloutConfig",
                 device: str | None = None):
        from transformers import AutoTokenizer

        from model.base import load_causal_lm, stop_token_ids

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_causal_lm(model_dir, model_cfg, attn_implementation="sdpa").to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._setup(Path(model_dir), model, tokenizer,
                    stop_token_ids(model_dir, model_cfg.eos_token_ids, tokenizer=tokenizer), rollout_cfg)

    @classmethod
    def from_model(cls, model, tokenizer, stop: "StopTokens", rollout_cfg, model_dir: Path | str = "<in memory>"):
        """An engine around an already loaded model (benches, tests)."""
        self = cls.__new__(cls)
        self._setup(Path(model_dir), model, tokenizer, stop, rollout_cfg)
        return self

    def _setup(self, model_dir: Path, model, tokenizer, stop, rollout_cfg) -> None:
        self.model_dir, self.rollout_cfg, self.tokenizer, self.stop = model_dir, rollout_cfg, tokenizer, stop
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop.ids[0]
        self.decoder = FastDecoder(self.model, self.pad_id, rollout_cfg.hf_batch_buckets, rollout_cfg.max_model_len,
                                   capture=rollout_cfg.hf_decode)
        self.adapter = AdapterSlot(self.model, rollout_cfg.hf_lora)
        self._version = 0
        self.last_load_s = 0.0
        self.log_stop_tokens()

    # ----------------------------------------------------------------- control plane

    def loaded_version(self) -> int:
        return self._version

    def load_adapter(self, payload: AdapterPayload) -> None:
        t0 = time.perf_counter()
        lora = parse_adapter(payload, self.decoder.device)
        if self.adapter.load(lora, payload.version) and self.adapter.mode == "unmerged":
            self.decoder.reset_graphs()  # the hooks (and their buffers) are new
        self._version = payload.version
        if self.decoder.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_load_s = time.perf_counter() - t0

    def stats(self) -> dict:
        """Capture (compile) seconds per bucket, kept apart from prefill/decode seconds."""
        return {**self.decoder.stats, "capture_s": dict(self.decoder.stats["capture_s"]),
                "last_load_s": self.last_load_s, "lora_mode": self.adapter.mode,
                "decode_mode": self.decoder.capture}

    # ----------------------------------------------------------------- data plane

    def generate(self, prompts: list[Prompt], params: SamplingParams, adapter_version: int) -> list[Sample]:
        if not prompts:
            return []
        prompt_ids, stop_ids = self.prepare(prompts, params, adapter_version)
        stop_strings = tuple(getattr(params, "stop", ()) or ())
        self.adapter.use(adapter_version, self._version)
        rows = [p for p in prompt_ids for _ in range(params.n)]
        toks, lps = self.decoder.decode(rows, params.max_tokens, params.temperature, params.top_k, params.top_p,
                                        stop_ids, params.seed)
        stop_set = set(stop_ids)
        samples = []
        for row in range(len(rows)):
            prompt_index, sample_index = divmod(row, params.n)
            t = toks[row].tolist()
            cut = next((i + 1 for i, x in enumerate(t) if x in stop_set), len(t))
            t = t[:cut]
            by_string = False
            if stop_strings:
                cut_s = stop_string_cut(self.tokenizer, t, stop_strings)
                by_string, t = cut_s is not None, t[:cut_s] if cut_s is not None else t
                cut = len(t)
            samples.append(Sample(
                prompt_index=prompt_index, sample_index=sample_index,
                text=self.tokenizer.decode(t, skip_special_tokens=True),
                prompt_token_ids=list(prompt_ids[prompt_index]), token_ids=t,
                logprobs=lps[row, :cut].tolist(),
                finish_reason="stop" if by_string else finish_reason(t, stop_ids),
                adapter_version=adapter_version,
            ))
        return samples
