"""Task "vowel-share": a synthetic verifier for speed benchmarks (bench/gpu_vs_trl.py's
`counterpoint train` side, configs/gpu-bench.yaml).

Each prompt asks for free text after ~``prompt_words`` words of filler. The reward of a
completion is the share of its letters that are vowels (0 without letters). It is the reward
bench/gpu_vs_trl.py gives TRL. It is dense, so the G completions of a group differ and every
step trains: no group is tied, even for a random-weight model. A plain task object (no gRPC, no
Ray), like every task in graders/tasks.py. One module: the task and its (empty) profile.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from graders.types import CaseInfo, PoolTooSmall, Score, TaskInfo, UnknownCase, UnknownSplit
from graders.tasks import TaskProfile, register_profile, register_task

NAME = "vowel-share"
WORDS = ("voice", "chord", "tonic", "bass", "soprano", "cadence", "motion", "parallel", "fifth", "octave",
         "measure", "degree", "leading", "tone", "resolve", "minor", "major", "interval", "contrary", "step")


def vowel_share(text: str) -> float:
    """Share of the letters of ``text`` that are vowels (a, e, i, o, u), 0.0 without letters."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def prompt_text(index: int, split: str, words: int) -> str:
    """The user message of case ``index`` of ``split``: seeded filler, distinct per case."""
    rng = random.Random(f"{split}-{index}")
    return f"Task {index}: " + " ".join(rng.choice(WORDS) for _ in range(words))


class VowelShareTask:
    name = NAME

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.splits = {"train": cfg.train_cases, "heldout": cfg.heldout_cases}

    def info(self) -> TaskInfo:
        return TaskInfo(pool_size=self.cfg.train_cases, heldout_pool_size=self.cfg.heldout_cases,
                        pool_source="generated", checker=NAME,
                        details={"prompt_words": self.cfg.prompt_words, "pass_share": self.cfg.pass_share})

    def cases(self, limit: int, split: str) -> list[CaseInfo]:
        if split not in self.splits:
            raise UnknownSplit(f"unknown split {split!r}; one of {sorted(self.splits)}")
        size = self.splits[split]
        if limit > size:
            raise PoolTooSmall(f"asked for {limit} {split} cases, the pool holds {size}")
        return [CaseInfo(id=f"vs-{split}-{i}", split=split, task=NAME,
                         messages=[{"role": "user", "content": prompt_text(i, split, self.cfg.prompt_words)}])
                for i in range(limit or size)]

    def _check(self, case_id: str) -> None:
        split, _, index = case_id.removeprefix("vs-").rpartition("-")
        if not case_id.startswith("vs-") or split not in self.splits or not index.isdigit() \
                or int(index) >= self.splits[split]:
            raise UnknownCase(f"unknown case_id {case_id[:80]!r}")

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Score]:
        out = []
        for case_id, completion in pairs:
            self._check(case_id)
            share = vowel_share(completion)
            admitted = share >= self.cfg.pass_share
            out.append(Score(case_id=case_id, reward=share, format_ok=True, admitted=admitted,
                             verdict="admitted" if admitted else "share", test_metric=share,
                             failing_rules=() if admitted else ("share",)))
        return out


@register_profile
class VowelShareProfile(TaskProfile):
    """Nothing for the driver to check or ask: the pool is generated, there are no openings."""

    name = NAME
    verdict_labels = ("admitted", "share")  # admitted, or its share fell short

    def verdict_label(self, verdict: str) -> str:
        return "admitted" if verdict == "admitted" else "share"


@register_task(NAME)
def vowel_share_task(cfg) -> VowelShareTask:
    """From a GraderConfig: its ``vowel_share`` section."""
    return VowelShareTask(cfg.vowel_share)
