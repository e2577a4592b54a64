"""Does the learner compute the same numbers under CUDA MPS at every SM share? A probe for the nan
of issue 34's second H100 lease: under MPS with the learner at 75% of the SMs, its first forward
gave nan (eager and compiled alike), while 50% was finite on another H100 and on the H200.

For each share (`none` = no MPS, else CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) a fresh child process,
optionally beside a second MPS client at 100% that keeps the GPU busy with decode-sized GEMMs
(the replica's place in a run), reports:
- the SM count CUDA gives it (an MPS share changes what the device properties say);
- model/gemm_check.py's check (the run's start-up check under a share): LoRA's and the base's
  GEMMs as autograd runs them, against fp32 on the CPU;
- kernels: bf16 GEMMs at the learner's shapes and every SDPA backend (flash, efficient, cudnn,
  math; causal, GQA, forward and backward), each finite or not and its distance to an fp32 math
  reference;
- the learner: PolicyLearner.for_run on bench/gpu_vs_trl.py's 4x8 config (the run's learner) on a
  fixed synthetic batch: the first module whose forward output is not finite (forward hooks),
  then one step's loss, grad norm and ppl_ratio, or the NonFiniteGradients it raised;
  with --shared, the learner maps a vLLM replica's base weights over CUDA IPC (model/shared_base.py)
  as in a run, the replica's engine started in the same child.
Every row is compared with the `none` row of the same run (log-prob sums; bf16 GEMMs may pick
other algorithms at another SM count, so equal to the last bit is not expected, finite is).

    python3 bench/mps_numerics.py --model /tmp/gpu-vs-trl/models/qwen3-4b --shares none,100,75,50 --out $OUT/mps-numerics.json
    python3 bench/mps_numerics.py --model ... --shares none,75 --beside-busy --shared
    python3 bench/mps_numerics.py --model ... --shares 60,75,50 --gpu-sharing   # the run's start-up check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS, RESPONSE_TOKENS, ROWS = 200, 384, 32  # bench/gpu_vs_trl.py's 4x8 rows
DEVICE = "cuda"  # --device cpu: the plumbing anywhere (fp32 there, MATH attention only)


def kernel_checks() -> dict:
    """bf16 GEMMs and every SDPA backend against fp32 references, forward and backward."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=DEVICE).manual_seed(0)
    low = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    out: dict = {}
    for m, k, n in ((ROWS * (PROMPT_TOKENS + RESPONSE_TOKENS) // 8, 2560, 9728), (2336, 9728, 2560), (8, 2560, 4096)):
        a = torch.randn(m, k, device=DEVICE, generator=g, dtype=low)
        b = torch.randn(k, n, device=DEVICE, generator=g, dtype=low) * k ** -0.5
        got, ref = (a @ b).float(), a.float() @ b.float()
        out[f"mm_{m}x{k}x{n}"] = {"finite": bool(torch.isfinite(got).all()),
                                   "max_rel": float((got - ref).abs().max() / ref.abs().max())}
    b_, h, kv, t, d = 4, 32, 8, PROMPT_TOKENS + RESPONSE_TOKENS, 128  # Qwen3-4B: 32 query heads, 8 kv heads
    q0 = torch.randn(b_, h, t, d, device=DEVICE, generator=g, dtype=low)
    k0 = torch.randn(b_, kv, t, d, device=DEVICE, generator=g, dtype=low)
    v0 = torch.randn(b_, kv, t, d, device=DEVICE, generator=g, dtype=low)
    go = torch.randn(b_, h, t, d, device=DEVICE, generator=g, dtype=low)

    def run(backend, dtype):
        q, k, v = (x.detach().to(dtype, copy=True).requires_grad_(True) for x in (q0, k0, v0))
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                               is_causal=True)
        o.backward(go.to(dtype))
        return [x.float() for x in (o, q.grad, k.grad, v.grad)]

    ref = run(SDPBackend.MATH, torch.float32)
    backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH) if DEVICE == "cuda" else (SDPBackend.MATH,)
    for backend in backends:
        try:
            got = run(backend, low)
        except RuntimeError as err:  # a backend this build or GPU lacks
            out[f"sdpa_{backend.name.lower()}"] = {"error": str(err).splitlines()[0][:200]}
            continue
        out[f"sdpa_{backend.name.lower()}"] = {
            "finite": all(bool(torch.isfinite(x).all()) for x in got),
            "max_rel": max(float((x - r).abs().max() / r.abs().max()) for x, r in zip(got, ref))}
    return out


def synthetic_batch(vocab: int):
    import torch

    from learner.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(vocab, 30000), (ROWS, PROMPT_TOKENS + RESPONSE_TOKENS), generator=g)
    adv = torch.randn(ROWS, generator=g)
    adv = ((adv - adv.mean()) / adv.std()).tolist()
    return TrainBatch(prompt_ids=ids[:, :PROMPT_TOKENS].tolist(), response_ids=ids[:, PROMPT_TOKENS:].tolist(),
                      rollout_logprobs=[[-10.0] * RESPONSE_TOKENS for _ in range(ROWS)], advantages=adv,
                      rewards=adv, group_ids=[i // 8 for i in range(ROWS)])


def learner_checks(model: Path, shared: bool) -> dict:
    """The run's learner on the synthetic batch: where a forward first goes non-finite, then a step."""
    import torch

    from bench.gpu_vs_trl import bench_config
    from learner.passes import NonFiniteGradients
    from learner.policy import PolicyLearner

    cfg = bench_config(model, 4, 2, tempfile.mkdtemp(prefix="cp-mps-numerics-"), gpu=DEVICE == "cuda",
                       engine="vllm" if shared else "hf", mode="one_step_off")
    out: dict = {}
    kwargs = {}
    if shared:
        from rollout.engines.vllm_engine import VllmEngine

        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gpu_memory_utilization": 0.3})})
        engine = VllmEngine(model, cfg.model, cfg.rollout, seed=0)
        kwargs = {"shared_base": engine.export_base(), "share_required": True}
    policy = PolicyLearner.for_run(cfg, device=DEVICE, **kwargs)
    out["base_weights"] = getattr(policy, "base_weights", None)
    batch = synthetic_batch(policy.peft_model.config.vocab_size)
    first_bad: list[str] = []

    def hook(module, inputs, output):
        x = output[0] if isinstance(output, tuple) else output
        if not first_bad and isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.isfinite(x).all():
            first_bad.append(names[module])

    names = {m: n for n, m in policy.peft_model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in names]
    ids = torch.tensor([p + r for p, r in zip(batch.prompt_ids[:8], batch.response_ids[:8])], device=DEVICE)
    # the learner keeps its adapter in fp32 and runs its passes under bf16 autocast
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        logits = policy.peft_model(input_ids=ids).logits.float()
    for h in handles:
        h.remove()
    lp = torch.log_softmax(logits[:, PROMPT_TOKENS - 1:-1], -1).gather(-1, ids[:, PROMPT_TOKENS:, None])
    out["forward"] = {"finite": bool(torch.isfinite(logits).all()), "first_nonfinite_module": first_bad[0] if first_bad else None,
                      "logprob_sum": float(lp.sum())}
    try:
        metrics, _ = policy.step(batch)
        out["step"] = {k: metrics.get(k) for k in ("loss", "grad_norm", "ppl_ratio", "entropy")}
    except NonFiniteGradients as err:
        out["step"] = {"nonfinite": str(err).splitlines()[0][:300]}
    return out


def child(args) -> int:
    import torch

    global DEVICE
    DEVICE = args.device
    props = torch.cuda.get_device_properties(0) if DEVICE == "cuda" else None
    row: dict = {"share": args.share, "gpu": props.name if props else "cpu",
                 "sm_count": props.multi_processor_count if props else None,
                 "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                 "mps": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is not None}
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    row["blas"] = str(torch.backends.cuda.preferred_blas_library()) if DEVICE == "cuda" else None
    t = time.perf_counter()
    row["kernels"] = kernel_checks()
    from model.gemm_check import FALLBACK_WIDTHS, check, learner_gemms  # Qwen3-4B's widths

    row["gemm_check"] = check(learner_gemms(FALLBACK_WIDTHS, 32, (4672, 8176)), DEVICE,
                              "bfloat16" if DEVICE == "cuda" else "float32")
    row["learner"] = learner_checks(args.model, args.shared)
    row["seconds"] = round(time.perf_counter() - t, 1)
    print("ROW " + json.dumps(row), flush=True)
    return 0


def busy() -> int:
    """A second MPS client at 100%: decode-sized bf16 GEMMs until it is killed."""
    import torch

    w = [torch.randn(2560, 9728, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    x = torch.randn(32, 2560, device="cuda", dtype=torch.bfloat16)
    print("BUSY", flush=True)
    while True:
        for m in w:
            x = (x @ m)[:, :2560].contiguous() * 0.01
        torch.cuda.synchronize()


def driver_version() -> str:
    from services.mps import find_driver_binary

    smi = find_driver_binary("nvidia-smi")  # also in the driver's bin directories; none on a CPU host
    if smi is None:
        return "unknown"
    return subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def gpu_sharing_start(model: Path, shares: list[str]) -> list[dict]:
    """The run's own path per share: services/mps.py GpuSharing with gpu_sharing.mode=mps on a real
    daemon, its start-up GEMM check (model/gemm_check.py) included: started, or refused in one line."""
    from config import RunConfig
    from services.mps import GpuSharing

    rows = []
    for share in shares:
        cfg = RunConfig.model_validate({
            "model": {"name_or_path": str(model), "dtype": "bfloat16"},
            "rollout": {"engine": "vllm", "num_gpus": 0.5, "max_tokens": RESPONSE_TOKENS, "max_num_seqs": 64},
            "learner": {"use_gpu": True, "gpus_per_worker": 0.5, "lora": {"r": 32}},
            "trainer": {"mode": "one_step_off"}, "gpu_sharing": {"mode": "mps", "learner_sm_percent": int(share)}})
        gpu = GpuSharing.for_run(cfg, Path(tempfile.mkdtemp(prefix="cp-gs-", dir="/tmp")) / "run")
        t = time.perf_counter()
        try:
            gpu.start()
            row = {"share": share, "started": True}
        except RuntimeError as err:
            row = {"share": share, "started": False, "refused": str(err)}
        finally:
            gpu.stop()
        row.update(seconds=round(time.perf_counter() - t, 1), numerics=gpu.record().get("numerics"))
        print("GPU_SHARING " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--shares", default="none,100,75,50", help="comma-separated: none or an SM percent")
    ap.add_argument("--beside-busy", action="store_true", help="a second MPS client at 100%% keeps the GPU busy")
    ap.add_argument("--shared", action="store_true", help="the learner maps a vLLM engine's base weights (needs vLLM)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gpu-sharing", action="store_true", help="only the run's start-up path per share "
                    "(services/mps.py GpuSharing, mode=mps, on its own daemon): started or refused")
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing without a GPU (--shares none only)")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), help="torch.backends.cuda.preferred_blas_library")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--share", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.busy:
        return busy()
    if args.model is None:
        ap.error("--model is required")
    if args.child:
        return child(args)

    from services.mps import GpuSharing, MpsPlan, find_control_binary

    shares = args.shares.split(",")
    if args.gpu_sharing:
        rows = gpu_sharing_start(args.model, [s for s in shares if s != "none"])
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "driver": driver_version(),
                                            "gpu_sharing": rows}, indent=2) + "\n")
        return 0
    binary = find_control_binary()
    if binary is None and shares != ["none"]:
        print("no nvidia-cuda-mps-control on this host: only --shares none runs here", file=sys.stderr)
        return 2
    pipe = tempfile.mkdtemp(prefix="cp-mps-")
    plan = MpsPlan("start" if shares != ["none"] else "none", "bench/mps_numerics.py", pipe_dir=pipe,
                   log_dir=f"{pipe}/log")
    mps = GpuSharing(plan, binary)
    mps.start()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "driver": driver_version(), "beside_busy": args.beside_busy,
              "shared": args.shared, "rows": []}

    def client_env(share: str) -> dict[str, str]:  # a learner client's variables, as a run's (MpsPlan.env)
        extra = {} if share == "none" else replace(plan, sm_percent={"learner": int(share)}).env("learner")
        return dict(os.environ, **extra)

    try:
        for share in shares:
            env = client_env(share)
            side = None
            if args.beside_busy:  # the neighbour at every SM, under the same daemon (or none)
                side_env = client_env("none" if share == "none" else "100")
                side = subprocess.Popen([sys.executable, __file__, "--busy"], env=side_env, stdout=subprocess.PIPE,
                                        text=True)
                side.stdout.readline()  # BUSY
            cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--share", share,
                   "--device", args.device] + (["--blas", args.blas] if args.blas else []) + (
                ["--shared"] if args.shared else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if side is not None:
                side.kill()
                side.wait()
            rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = rows[0] if rows else {"share": share, "exit": done.returncode,
                                        "error": (done.stderr or "").strip().splitlines()[-5:]}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        mps.stop()
    base = next((r for r in report["rows"] if r.get("share") == "none" and "learner" in r), None)
    print(f"\n| share | SMs | kernels not finite | GEMMs off by > 2% (model/gemm_check.py) | forward | first non-finite module | step | logprob sum - none's |  ({report['driver']})")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        if "learner" not in r:
            print(f"| {r['share']} | | failed: {r.get('error')} | | | | | |")
            continue
        bad = [k for k, v in r["kernels"].items() if v.get("finite") is False]
        off = r["gemm_check"]["off"]
        f, s = r["learner"]["forward"], r["learner"]["step"]
        step = s.get("nonfinite") or f"loss {s['loss']:.4g} grad {s['grad_norm']:.4g} ppl {s['ppl_ratio']:.4g}"
        diff = f["logprob_sum"] - base["learner"]["forward"]["logprob_sum"] if base else float("nan")
        print(f"| {r['share']} | {r['sm_count']} | {', '.join(bad) or 'none'} | {len(off)} of {r['gemm_check']['checked']}: {', '.join(off[:4]) or '-'} | {'finite' if f['finite'] else 'NOT finite'} "
              f"| {f['first_nonfinite_module'] or '-'} | {step} | {diff:.4g} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
