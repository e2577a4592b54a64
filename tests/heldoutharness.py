"""A train run's held-out before/after, written as the driver writes it (evals/heldout.py),
from real held-out cases and chosen verdicts: for the interval, receipt and plot tests."""

from __future__ import annotations

from pathlib import Path

from graders.client import Score
from graders.voice_leading.pool import load_pool
from rollout.types import Sample, SamplingParams
from config.rollout import RolloutConfig
from records.run_dir import RunDir
from evals.heldout import HeldoutResult, heldout_prompts, write_heldout_eval

PARAMS = SamplingParams.from_rollout(RolloutConfig(), n=1, temperature=1.0, max_tokens=48, seed=7 * 1_000_003)


def heldout_result(cases, admitted: list[bool], version: int) -> HeldoutResult:
    """One completion per case (the default run's eval.generations=1), forced openings."""
    prompts = heldout_prompts(cases, 1, "forced_opening")
    samples, scores = [], []
    for i, (case, prompt, ok) in enumerate(zip(cases, prompts, admitted, strict=True)):
        samples.append(Sample(prompt_index=i, sample_index=0, text=f" 1]}}] completion {i}",
                              prompt_token_ids=[1, 2, 3], token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3],
                              finish_reason="stop", adapter_version=version))
        scores.append(Score(case_id=case.id, reward=float(ok), format_ok=True, admitted=ok,
                            verdict="admitted" if ok else "parallels", failing_rules=() if ok else ("parallels",),
                            sounding_frames=2, expected_frames=2, opening=prompt.assistant_prefix[-8:],
                            first_measure_ok=True, status="ok"))
    return HeldoutResult(version, list(cases), prompts, samples, scores, 1)


def write_before_after(run_root: Path, before: list[bool], after: list[bool] | None) -> RunDir:
    """heldout_before.jsonl (base model, v0) and heldout_after.jsonl (v9) of len(before) cases."""
    cases = load_pool(voices=2, style="common-practice", bars=2).take(len(before), "heldout")
    run = RunDir(run_root).create()
    for when, admitted, version in (("before", before, 0), ("after", after, 9)):
        if admitted is not None:
            write_heldout_eval(run.heldout_path(when), heldout_result(cases, admitted, version), PARAMS,
                               model="smollm2-135m-instruct", voices=2, eos_token_ids=[2],
                               prefix_mode="forced_opening", fixture_source="shipped", run=str(run.root))
    return run
