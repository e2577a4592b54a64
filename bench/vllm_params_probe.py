"""What a vLLM engine's model holds, as a learner that maps it sees it (issue 31, the shared base):
every parameter name (tied ones too), which are on the meta device, and how the output head is
held. Written after the 14B/32B benches of 2026-12-03 on vLLM 0.26: the learner found no
lm_head.weight among the replica's 322 tensors (Qwen3-14B, untied, unmerged LoRA), and a 32B
export failed pickling a tensor with no memory ('_share_filename_: only available on CPU').

    python3 bench/vllm_params_probe.py --model /tmp/gpu-vs-trl/models/qwen3-32b [--lora] [--gpu-util 0.62]

One JSON line per engine on stdout ("PROBE {...}"). Random weights (load_format=dummy), eager.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def probe(model) -> dict:
    import torch

    named = list(model.named_parameters(remove_duplicate=False))
    unique = {id(p) for _, p in named}
    heads = {n: (tuple(p.shape), str(p.device), type(p).__name__) for n, p in named
             if "lm_head" in n or "embed_tokens" in n or "logits" in n}
    lm = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return {
        "parameters": len(named), "unique": len(unique),
        "meta": [n for n, p in named if p.is_meta][:20],
        "not_cuda": [(n, str(p.device)) for n, p in named if not p.is_cuda and not p.is_meta][:20],
        "heads": heads,
        "lm_head_type": type(lm).__name__ if lm is not None else None,
        "lm_head_is_embed": lm is not None and lm is embed,
        "lm_head_weight_is_embed": bool(lm is not None and embed is not None
                                        and getattr(lm, "weight", None) is getattr(embed, "weight", 0)),
        "modules_with_head": {n: type(m).__name__ for n, m in model.named_modules() if "lm_head" in n or "logits" in n},
        "tie_word_embeddings": getattr(model.config, "tie_word_embeddings", None) if hasattr(model, "config") else None,
        "cuda_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lora", action="store_true", help="enable vLLM's LoRA (unmerged: its wrappers around the layers)")
    ap.add_argument("--gpu-util", type=float, default=0.35)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model runs in this process
    from vllm import LLM

    with open(os.path.join(args.model, "config.json")) as fh:
        print("config.json tie_word_embeddings:", json.load(fh).get("tie_word_embeddings", "absent"), flush=True)
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=640,
              gpu_memory_utilization=args.gpu_util, max_num_seqs=8,
              **(dict(enable_lora=True, max_lora_rank=32, max_loras=2) if args.lora else {}))
    for result in llm.apply_model(probe):
        print("PROBE", json.dumps({"model": os.path.basename(args.model.rstrip("/")), "lora": args.lora, **result}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
