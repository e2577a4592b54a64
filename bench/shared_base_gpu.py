"""The shared base on a GPU: the check issue 31 item 4 asks of the GPU bench.

A vLLM replica's engine (merged LoRA; its engine core in its own process, as in a run) lends its
weights over CUDA IPC to a PolicyLearner in this process (model/shared_base.py); a second
PolicyLearner loads its own copy. Each step samples G=8 completions of one prompt from the
replica, then both learners take the step from the same adapter and optimizer state:
- sync steps (the replica serves the learner's version): ppl_ratio of the shared learner against
  vLLM's own log-probs within 1 +- 0.02, and its loss and grad norm against the own copy's;
- a last one_step_off step (the replica one version behind the learner): loss and grad norm
  against the own copy's (ppl_ratio then measures the policy's move, not an error).
It also says what the shared learner allocated for its model (no weights) and the GPU's total.

    python3 bench/shared_base_gpu.py --model /tmp/gpu-vs-trl/models/qwen3-4b --tokenizer /tmp/cp-tok/tokenizer \
        --out $OUT/shared-base-4b.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
PPL_TOLERANCE = 0.02
# bf16: the served weights W0 + s B_v A_v are rounded to 8 bits of mantissa once (on the CPU test
# model 0.44 % at most; tests/test_shared_base.py)
RTOL = 0.01


def gpu_used_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return float(out[0]) / 1024 if out else float("nan")


def align(learner, like) -> None:
    """``learner`` at ``like``'s adapter and optimizer state."""
    import torch

    params = dict(like.peft_model.named_parameters())
    with torch.no_grad():
        for name, p in learner.peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(params[name])
    learner.optimizer.load_state_dict(like.optimizer.state_dict())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3, help="sync steps; one one_step_off step follows")
    ap.add_argument("--lr", type=float, default=2e-4, help="large enough that the merged adapter matters")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    args = ap.parse_args()

    import torch

    from bench.gpu_vs_trl import GROUP_SIZE, NEW_TOKENS, bench_config, prompt_texts
    from learner.policy import PolicyLearner
    from learner.types import TrainBatch
    from rollout.engines.vllm_engine import VllmEngine
    from rollout.types import Prompt, SamplingParams

    cfg = bench_config(args.model, 1, args.steps + 1, "/tmp/cp-shared-runs", engine="vllm")
    cfg = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"gpu_memory_utilization": args.gpu_memory_utilization,
                                                  "vllm_lora": "merged"}),
        "learner": cfg.learner.model_copy(update={"lr": args.lr})})
    report: dict = {"model": args.model.name, "date": time.strftime("%Y-%m-%d"), "steps": []}
    t = time.perf_counter()
    engine = VllmEngine(args.model, cfg.model, cfg.rollout, seed=0)
    report["engine_start_s"] = round(time.perf_counter() - t, 1)
    report["gpu_used_after_engine_gib"] = round(gpu_used_gib(), 2)
    export = engine.export_base()
    before = torch.cuda.memory_allocated()
    shared = PolicyLearner.for_run(cfg, device="cuda", shared_base=export, share_required=True)
    report["shared_learner_allocated_gib"] = round((torch.cuda.memory_allocated() - before) / GIB, 3)
    report["base_weights"] = shared.base_weights
    report["gpu_used_after_shared_learner_gib"] = round(gpu_used_gib(), 2)
    before = torch.cuda.memory_allocated()
    own = PolicyLearner.for_run(cfg, device="cuda")
    report["own_learner_allocated_gib"] = round((torch.cuda.memory_allocated() - before) / GIB, 3)
    text = prompt_texts(args.tokenizer, 1)[0]
    prompt = Prompt(messages=({"role": "user", "content": text},))
    engine.load_adapter(shared.payload(1))
    served = 1
    gen = torch.Generator().manual_seed(0)
    ok = True
    for step in range(1, args.steps + 2):
        params = SamplingParams(n=GROUP_SIZE, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=NEW_TOKENS, seed=step)
        samples = engine.generate([prompt], params, served)
        adv = torch.randn(len(samples), generator=gen)
        adv = ((adv - adv.mean()) / adv.std()).tolist()
        batch = TrainBatch(prompt_ids=[s.prompt_token_ids for s in samples], response_ids=[s.token_ids for s in samples],
                           rollout_logprobs=[s.logprobs for s in samples], advantages=adv, rewards=adv,
                           group_ids=[0] * len(samples))
        align(own, shared)
        (m_shared, p_shared), (m_own, p_own) = shared.step(batch), own.step(batch)
        mode = "sync" if step <= args.steps else "one_step_off"
        row = {"step": step, "mode": mode, "served_version": served, "learner_version": step,
               **{f"{k}_shared": m_shared[k] for k in ("loss", "grad_norm", "ppl_ratio")},
               **{f"{k}_own": m_own[k] for k in ("loss", "grad_norm", "ppl_ratio")}}
        row["update_s_shared"], row["update_s_own"] = round(p_shared["update_actor"], 3), round(p_own["update_actor"], 3)
        row["loss_rel"] = abs(m_shared["loss"] - m_own["loss"]) / max(abs(m_own["loss"]), 1e-12)
        row["grad_norm_rel"] = abs(m_shared["grad_norm"] - m_own["grad_norm"]) / max(m_own["grad_norm"], 1e-12)
        checks = [row["loss_rel"] <= RTOL or abs(m_shared["loss"] - m_own["loss"]) < 1e-4, row["grad_norm_rel"] <= RTOL]
        if mode == "sync":
            checks.append(abs(m_shared["ppl_ratio"] - 1) <= PPL_TOLERANCE)
        row["ok"] = all(checks)
        ok &= row["ok"]
        report["steps"].append(row)
        print(json.dumps(row), flush=True)
        if mode == "sync" and step < args.steps + 1:
            if step < args.steps:  # sync: the replica serves what the learner trains next
                engine.load_adapter(shared.payload(step + 1))
                served = step + 1
    report["ok"] = ok
    report["engine_stats"] = engine.stats()
    report["gpu_used_end_gib"] = round(gpu_used_gib(), 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("shared base check:", "OK" if ok else "FAILED", json.dumps({k: v for k, v in report.items() if k != "steps"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
