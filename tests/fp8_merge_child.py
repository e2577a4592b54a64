"""Merged LoRA over vLLM's online fp8 layers, checked in a process of its own (vLLM's one-rank
process group and its model classes; tests/test_rollout_fp8.py runs it and reads its JSON answer).

vLLM's own Qwen3 model is built with quantization='fp8' on the CPU, its weights loaded by its own
loader and quantized by its own online fp8 method, the way a replica's worker does it on a GPU,
and the adapters reach it through counterpoint's worker extension (``counterpoint_hold`` from a
file in shared memory, ``counterpoint_use``), as the engine calls it.
The fp8 kernel itself (vllm._custom_ops.scaled_fp8_quant) exists only in vLLM's CUDA build, so a
torch implementation of per-tensor fp8 quantization (amax / 448, round to float8_e4m3fn) stands
in for it, on both sides of every comparison. Everything else is vLLM's: the fused qkv/gate_up
layers, the online method's processing and the layerwise reload a merge runs inside.

The checks (each a number or a flag in the answer, asserted by the test):
- the merge of adapter v gives, bit for bit, the fp8 weights and scales of a fresh model loaded
  from the merged checkpoint (W0 + s B A, rounded to bf16, written to disk);
- version 0 gives back, bit for bit, what the start-up quantized;
- an adapter on q and v only writes k's W0 with them (the fused layer is quantized whole) and
  still equals its merged checkpoint;
- the kernel tensors keep their storage (CUDA graphs captured on them stay valid);
- a write that leaves a fused layer short of a shard is refused, not quantized.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def main(model_dir: str, payload_dirs: list[str]) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.synthetic
    from bench.synthetic import build_vllm_model, init_vllm_distributed, reference_fp8_quant

    init_vllm_distributed(model_dir)
    import vllm._custom_ops as ops
    from vllm.config import set_current_vllm_config

    from model.adapter import AdapterPayload
    from model.adapter_dir import AdapterError
    from rollout.engines.lora_weights import merged_weight, parse_adapter
    from rollout.engines.vllm_merge import MergedLoraExtension, OnlineQuantizedReload, online_quantized, write_shm

    ops.scaled_fp8_quant = reference_fp8_quant

    def build(checkpoint: str):
        return build_vllm_model(checkpoint, "bfloat16", quantization="fp8")

    def kernels(model) -> dict:
        return {name: t.detach().clone() for name, t in model.named_parameters()}

    def differing(a: dict, b: dict) -> list[str]:
        # fp8 has no comparison kernel on the CPU: compare the bits
        def bits(t):
            return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return sorted(n for n in a if not torch.equal(bits(a[n]), bits(b[n])))

    answer: dict = {}
    model, config = build(model_dir)
    answer["online_quantized"] = online_quantized(model)
    answer["qkv_dtype"] = str(model.model.layers[0].self_attn.qkv_proj.weight.dtype)
    at_start = kernels(model)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    base = load_file(f"{model_dir}/model.safetensors")

    class Worker(MergedLoraExtension):  # what vLLM's Worker gives the extension: the engine's calls go here
        model_runner = SimpleNamespace(get_model=lambda model=model: model)
        model_config = config.model_config

    worker = Worker()
    with set_current_vllm_config(config):
        for version, payload_dir in enumerate(payload_dirs, start=1):
            payload = AdapterPayload(version=version,
                                     safetensors=(Path(payload_dir) / "adapter_model.safetensors").read_bytes(),
                                     config=json.loads((Path(payload_dir) / "adapter_config.json").read_text()))
            path = write_shm(payload)  # as the engine hands it over (vllm_engine.py _hold_merged)
            try:
                worker.counterpoint_hold(path, json.dumps(payload.config), version)
            finally:
                os.unlink(path)
            answer["scope"] = type(worker._counterpoint_merged().scope).__name__
            lora = parse_adapter(payload)
            # the merged checkpoint, loaded fresh by vLLM with quantization='fp8'
            state = dict(base)
            for layer, tensors in lora.items():
                state[f"{layer}.weight"] = merged_weight(base[f"{layer}.weight"], tensors)
            with tempfile.TemporaryDirectory() as ckpt:
                for f in Path(model_dir).iterdir():
                    if f.name != "model.safetensors":
                        (Path(ckpt) / f.name).write_bytes(f.read_bytes())
                save_file(state, f"{ckpt}/model.safetensors", metadata={"format": "pt"})
                fresh, _ = build(ckpt)
            answer[f"v{version}_layers"] = sorted(lora)
            answer[f"v{version}_differs_from_fresh"] = differing(kernels(model), kernels(fresh))
            answer[f"v{version}_differs_from_start"] = len(differing(kernels(model), at_start))
        worker.counterpoint_use(0)
        answer["v0_differs_from_start"] = differing(kernels(model), at_start)
        answer["storage_moved"] = sorted(n for n, p in model.named_parameters() if p.data_ptr() != storage[n])

        # a write short of a shard: q and v of layer 0's qkv_proj without k
        scope = OnlineQuantizedReload(model, config.model_config)
        short = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
        try:
            with scope.writing(short):
                model.load_weights((f"{n}.weight", base[f"{n}.weight"]) for n in short)
            answer["short_write"] = "accepted"
        except AdapterError as err:
            answer["short_write"] = str(err)
    return answer


if __name__ == "__main__":
    print("ANSWER " + json.dumps(main(sys.argv[1], sys.argv[2:])))
