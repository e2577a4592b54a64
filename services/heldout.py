"""Held-out pass rate: sample completions for held-out cases on the rollout service and score
them on the grader service. Used before and after training (`counterpoint train`) and by
`counterpoint eval`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rollout.types import Prompt, Sample, SamplingParams


@dataclass
class HeldoutResult:
    adapter_version: int
    cases: list[Any]
    prompts: list[Prompt]  # per completion
    samples: list[Sample]  # per completion, prompt order
    scores: list[Any]  # per completion
    generations: int

    def items(self) -> list[Any]:
        """One EVAL.jsonl item per case (services/evalfile.py owns the statistics)."""
        from services.evalfile import item_record

        g = self.generations
        out = []
        for i, case in enumerate(self.cases):
            prompts, samples = self.prompts[i * g:(i + 1) * g], self.samples[i * g:(i + 1) * g]
            out.append(item_record(
                case.id, [p.assistant_prefix + s.text for p, s in zip(prompts, samples)],
                [len(s.token_ids) for s in samples], self.scores[i * g:(i + 1) * g], len(case.openings)))
        return out

    def summary(self) -> dict[str, float]:
        from services.evalfile import summarize

        return dict(vars(summarize(self.items())))


def heldout_prompts(cases: Sequence[Any], generations: int, prefix_mode: str) -> list[Prompt]:
    """`generations` prompts per case; with forced openings completion i gets opening
    i mod |alphabet|, exactly as in training, so before/after numbers are comparable."""
    prompts = []
    for case in cases:
        messages = tuple({"role": m["role"], "content": m["content"]} for m in case.messages)
        prefixes = list(case.prefixes) if prefix_mode == "forced_opening" else []
        for i in range(generations):
            prompts.append(Prompt(messages, prefixes[i % len(prefixes)] if prefixes else ""))
    return prompts


def evaluate_heldout(grader: Any, rollout: Any, cases: Sequence[Any], params: SamplingParams,
                     adapter_version: int, prefix_mode: str = "none") -> HeldoutResult:
    generations = params.n
    prompts = heldout_prompts(cases, generations, prefix_mode)
    single = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids, seed=params.seed)
    samples = sorted(rollout.generate(prompts, single, adapter_version), key=lambda s: s.prompt_index)
    items = [(case.id, p.assistant_prefix + s.text)
             for case_index, case in enumerate(cases)
             for p, s in zip(prompts[case_index * generations:(case_index + 1) * generations],
                             samples[case_index * generations:(case_index + 1) * generations])]
    scores = grader.score_batch(items)
    return HeldoutResult(adapter_version, list(cases), prompts, samples, scores, generations)
