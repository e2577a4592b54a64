"""EVAL.jsonl: the held-out evaluation file, and its summary.

One evaluation (one model/adapter, one prompt set, one seed) is one file. It is written by
`counterpoint eval` and read by `counterpoint prior-shape` and `counterpoint compare`.

Format (JSON Lines, UTF-8, one JSON object per line):

Line 1 — the header::

    {"kind": "eval_header",
     "prompt_set": {"split": "heldout", "ids_sha256": "<hex>", "n_items": 32,
                    "fixture_source": "graders/voice_leading/data/heldout.json", "prompts_sha256": null,
                    "prefix_mode": "none"},
     "generation": {"generations": 8, "max_new_tokens": 256, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "seed": 0, "eos_token_ids": [2]},
     "model": "<base model name or path>", "adapter": "<adapter dir>" | null,
     "voices": 2, "alphabet_size": 16, "run": "<run dir>" | null,
     "scoring": {"style": "common-practice", "checker": "reference"} | null}

``ids_sha256`` is :func:`ids_sha256` of the items' ids: sha256 of the ids sorted and joined by
``\\n``, so it names the prompt *set* whatever order the items are written in.
``prompts_sha256`` (optional) hashes the rendered prompts, catching a fixture edited under the same
ids. ``fixture_source`` is informational (paths differ between machines). ``prefix_mode`` says
whether the assistant turn was forced to start with an opening (spec §13.3).
``alphabet_size`` is the nominal alphabet of valid openings, 4**voices (spec §13.2).
``generation.seed`` is the one generation field allowed to differ between compared runs;
``eos_token_ids`` is stored as a sorted set. ``scoring`` (optional) is compared when both runs
carry it.

Lines 2.. — one line per item::

    {"item_id": "...", "completions": [str × G], "openings": [str × G], "lengths": [int × G],
     "rewards": [float × G], "verdicts": [str × G], "admitted": [bool × G],
     "distinct_exact": int, "distinct_stripped": int, "pass_count": int, "alphabet_size": int}

``openings[i]`` is the opening of completion i (spec §13.1), ``"(none)"`` when nothing parsed.
A code-exec eval (``scoring.style`` CODE_EXEC_STYLE: a tree run's drafts scored on the tasks'
test rows) has ``"statuses": [str × G]`` instead of ``openings``: each completion's script status
(records.exec_result.EXEC_STATUSES), ``admitted`` only where it is ``ok``; ``"no_code"``
(no script found) is its unparseable. Files written before ``statuses`` existed kept the status
in ``openings``; they are read as ``statuses``.
``lengths`` are generated token counts. ``distinct_exact`` counts distinct completion strings;
``distinct_stripped`` counts distinct strings once every whitespace character is removed (so
``[0, 1]`` and ``[0,1]`` are one). ``pass_count`` = number of admitted completions.
The item's ``alphabet_size`` is its own (0 when its first named chord is out of vocabulary).

:func:`read_eval` checks all of this and names the line of anything wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from config.run import EvalConfig

_EVAL = EvalConfig()  # the schema's defaults: declared there, read here
NO_OPENING = "(none)"  # the opening of a completion with no parsed entry (spec §13.1)
NO_CODE = "no_code"  # the status of a code-exec completion with no script in it (nothing to run)
# ScoringSettings.style of a code-exec eval: drafts scored on the tasks' TEST rows, items with
# statuses (a tree run's held-out evals, evals/heldout.py evaluate_tree_heldout).
CODE_EXEC_STYLE = "code-exec test rows"


def nominal_alphabet_size(voices: int) -> int:
    """Openings are degree tuples over 0..3, one degree per voice (spec §13.2)."""
    return 4**voices


def ids_sha256(item_ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(item_ids)).encode("utf-8")).hexdigest()


def prompts_sha256(prompts_by_id: Mapping[str, Any]) -> str:
    """Hash of the rendered prompts (any JSON value per item id: messages, prefix), id-sorted."""
    canonical = json.dumps(sorted(prompts_by_id.items()), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def strip_whitespace(text: str) -> str:
    return "".join(text.split())


class EvalFileError(ValueError):
    """An EVAL.jsonl that is missing, malformed or inconsistent; the message names the line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PromptSet(_Strict):
    split: str
    ids_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    n_items: int = Field(ge=0)
    fixture_source: str | None = None
    prompts_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$",
        description="Optional hash of the rendered prompts; compared when both runs carry it.",
    )
    prefix_mode: str | None = Field(
        None,
        description="How the assistant turn starts ('none', 'forced_opening'); with forced "
        "openings the openings are the prefixes', not the model's choice.",
    )


class GenerationSettings(_Strict):
    generations: int = Field(ge=1, description="G: completions sampled per prompt.")
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    top_k: int
    seed: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)

    @field_validator("eos_token_ids")
    @classmethod
    def _as_sorted_set(cls, ids: list[int]) -> list[int]:
        return sorted(set(ids))  # a set of stop ids: [5, 2] and [2, 5] are the same setting

    @classmethod
    def from_sampling_params(
        cls, params: Any, eos_token_ids: Iterable[int] = ()
    ) -> GenerationSettings:
        """From rollout.types.SamplingParams (n, max_tokens, temperature, top_p, top_k, seed,
        stop_token_ids); ``eos_token_ids`` are the model's own, stop ids are added to them."""
        eos = sorted({int(t) for t in eos_token_ids} | {int(t) for t in params.stop_token_ids})
        return cls(
            generations=params.n,
            max_new_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            eos_token_ids=eos,
        )

    def comparable_fields(self) -> dict[str, Any]:
        """Everything that must match between compared runs: all but the seed."""
        return self.model_dump(exclude={"seed"})


class ScoringSettings(_Strict):
    """How completions were scored; rewards under different styles/checkers do not compare."""

    style: str
    checker: str


class EvalHeader(_Strict):
    kind: Literal["eval_header"] = "eval_header"
    prompt_set: PromptSet
    generation: GenerationSettings
    model: str
    adapter: str | None = None
    voices: int = Field(ge=1)
    alphabet_size: int = Field(ge=0)
    run: str | None = None
    scoring: ScoringSettings | None = None


class EvalItem(_Strict):
    item_id: str = Field(min_length=1)
    completions: list[str]
    openings: list[str] | None = Field(
        None, description="Voice-leading: the opening of each completion ((none) = nothing parsed).")
    statuses: list[str] | None = Field(
        None, description="Code-exec: the status of each completion's script (no_code = no script).")
    lengths: list[int]
    rewards: list[float]
    verdicts: list[str]
    admitted: list[bool]
    distinct_exact: int = Field(ge=0)
    distinct_stripped: int = Field(ge=0)
    pass_count: int = Field(ge=0)
    alphabet_size: int = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> EvalItem:
        g = len(self.completions)
        if (self.openings is None) == (self.statuses is None):
            raise ValueError("an item has openings (voice-leading) or statuses (code-exec): exactly one of them")
        for name in ("openings" if self.openings is not None else "statuses", "lengths", "rewards", "verdicts",
                     "admitted"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, completions {g}")
        if any(n < 0 for n in self.lengths):
            raise ValueError("lengths must be >= 0")
        if not all(math.isfinite(r) for r in self.rewards):
            raise ValueError("rewards must be finite")
        if self.pass_count != sum(self.admitted):
            raise ValueError(f"pass_count {self.pass_count} != {sum(self.admitted)} admitted")
        if self.distinct_exact != len(set(self.completions)):
            raise ValueError(
                f"distinct_exact {self.distinct_exact} != {len(set(self.completions))} "
                "distinct completions"
            )
        stripped = len({strip_whitespace(c) for c in self.completions})
        if self.distinct_stripped != stripped:
            raise ValueError(f"distinct_stripped {self.distinct_stripped} != {stripped}")
        for i, (opening, admitted) in enumerate(zip(self.openings or (), self.admitted)):
            if opening == NO_OPENING and admitted:
                # spec §11: an unparseable completion is always `structure`, reward 0
                raise ValueError(f"completion {i} is unparseable ({NO_OPENING}) yet admitted")
        for i, (status, admitted) in enumerate(zip(self.statuses or (), self.admitted)):
            if admitted and status != "ok":  # only a graded script can pass
                raise ValueError(f"completion {i} is admitted with status {status!r}")
        return self

    @property
    def generations(self) -> int:
        return len(self.completions)

    @property
    def unparseable(self) -> int:
        """Completions with nothing to judge: no opening parsed, or no script found."""
        if self.statuses is not None:
            return sum(s == NO_CODE for s in self.statuses)
        return sum(o == NO_OPENING for o in self.openings)


@dataclass(frozen=True)
class EvalFile:
    path: Path
    header: EvalHeader
    items: tuple[EvalItem, ...]


class ScoreLike(Protocol):
    """What :func:`item_record` needs from a grader result (a graders.types.Score)."""

    admitted: bool
    verdict: str


def item_record(
    item_id: str,
    completions: Sequence[str],
    lengths: Sequence[int],
    scores: Sequence[ScoreLike],
    alphabet_size: int,
    openings: Sequence[str] | None = None,
    statuses: Sequence[str] | None = None,
    opening_of: Callable[[str], str | None] | None = None,
) -> EvalItem:
    """Build one item line from G completions and their scores.

    ``scores`` are grader Scores (or anything with ``admitted``, ``verdict`` and optionally
    ``reward`` and ``opening``). ``openings`` default to each score's ``opening`` (what the grader
    parsed), else ``opening_of`` of the completion: the task's (graders/tasks.py
    TaskProfile.opening_of), so evals parse no task's output themselves; NO_OPENING where there
    is neither. ``alphabet_size`` is the case's number of valid openings (voice-leading: its
    opening alphabet). A code-exec item gives ``statuses`` (each script's status) and has no
    openings.
    """
    if len(scores) != len(completions):
        raise ValueError(f"{item_id}: {len(scores)} scores for {len(completions)} completions")
    if statuses is not None:
        if openings is not None:
            raise ValueError(f"{item_id}: give openings (voice-leading) or statuses (code-exec), not both")
    elif openings is None:
        openings = [
            getattr(s, "opening", None) or (opening_of and opening_of(c)) or NO_OPENING
            for s, c in zip(scores, completions)
        ]
    admitted = [bool(s.admitted) for s in scores]
    rewards = [float(getattr(s, "reward", 1.0 if a else 0.0)) for s, a in zip(scores, admitted)]
    return EvalItem(
        item_id=item_id,
        completions=list(completions),
        openings=None if openings is None else list(openings),
        statuses=None if statuses is None else list(statuses),
        lengths=[int(n) for n in lengths],
        rewards=rewards,
        verdicts=[str(s.verdict) for s in scores],
        admitted=admitted,
        distinct_exact=len(set(completions)),
        distinct_stripped=len({strip_whitespace(c) for c in completions}),
        pass_count=sum(admitted),
        alphabet_size=alphabet_size,
    )


def header_for(
    items: Sequence[EvalItem],
    *,
    generation: GenerationSettings,
    model: str,
    voices: int,
    split: str = _EVAL.split,
    fixture_source: str | None = None,
    prompts_sha256: str | None = None,
    prefix_mode: str | None = None,
    adapter: str | None = None,
    run: str | None = None,
    scoring: ScoringSettings | None = None,
) -> EvalHeader:
    """The header describing ``items`` (ids hash and count computed from them)."""
    return EvalHeader(
        prompt_set=PromptSet(
            split=split,
            ids_sha256=ids_sha256(i.item_id for i in items),
            n_items=len(items),
            fixture_source=fixture_source,
            prompts_sha256=prompts_sha256,
            prefix_mode=prefix_mode,
        ),
        generation=generation,
        model=model,
        adapter=adapter,
        voices=voices,
        alphabet_size=nominal_alphabet_size(voices),
        run=run,
        scoring=scoring,
    )


def write_eval(path: str | Path, header: EvalHeader, items: Iterable[EvalItem]) -> Path:
    """Write header + items; refuses a header whose prompt set does not describe the items."""
    items = list(items)
    _check_items_against_header(header, items, where=str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        f.write(header.model_dump_json() + "\n")
        for item in items:  # an item carries the one of openings / statuses its task has
            f.write(item.model_dump_json(exclude={"statuses" if item.statuses is None else "openings"}) + "\n")
    return path


def _format_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(line)"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def read_eval(path: str | Path) -> EvalFile:
    """Read and validate an EVAL.jsonl; every error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise EvalFileError(f"{path}: no such eval file")
    header: EvalHeader | None = None
    items: list[EvalItem] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                raise EvalFileError(f"{path}:{lineno}: empty line")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalFileError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise EvalFileError(f"{path}:{lineno}: expected a JSON object")
            if lineno == 1:
                if obj.get("kind") != "eval_header":
                    raise EvalFileError(
                        f"{path}:1: the first line must be the header "
                        f'({{"kind": "eval_header", ...}}), got kind={obj.get("kind")!r}'
                    )
                try:
                    header = EvalHeader.model_validate(obj)
                except ValidationError as e:
                    raise EvalFileError(f"{path}:1: bad header: {_format_validation(e)}") from None
                continue
            assert header is not None
            if (header.scoring is not None and header.scoring.style == CODE_EXEC_STYLE
                    and "statuses" not in obj and "openings" in obj):
                statuses = obj.pop("openings")  # written before statuses: each status was there
                obj = {**obj, "statuses": statuses}
            try:
                item = EvalItem.model_validate(obj)
            except ValidationError as e:
                raise EvalFileError(f"{path}:{lineno}: bad item: {_format_validation(e)}") from None
            if item.item_id in seen:
                raise EvalFileError(
                    f"{path}:{lineno}: item_id {item.item_id!r} repeats line {seen[item.item_id]}"
                )
            seen[item.item_id] = lineno
            if item.generations != header.generation.generations:
                raise EvalFileError(
                    f"{path}:{lineno}: item {item.item_id!r} has {item.generations} completions, "
                    f"the header says generations={header.generation.generations}"
                )
            items.append(item)
    if header is None:
        raise EvalFileError(f"{path}: empty file (no header line)")
    _check_items_against_header(header, items, where=str(path))
    return EvalFile(path=path, header=header, items=tuple(items))


def _check_items_against_header(header: EvalHeader, items: list[EvalItem], where: str) -> None:
    ps = header.prompt_set
    if len(items) != ps.n_items:
        raise EvalFileError(f"{where}: header says n_items={ps.n_items}, found {len(items)} items")
    digest = ids_sha256(i.item_id for i in items)
    if digest != ps.ids_sha256:
        raise EvalFileError(
            f"{where}: the items' ids hash to {digest[:12]}…, the header's prompt_set.ids_sha256 "
            f"is {ps.ids_sha256[:12]}… (items do not belong to the stated prompt set)"
        )
    for item in items:
        if item.generations != header.generation.generations:
            raise EvalFileError(
                f"{where}: item {item.item_id!r} has {item.generations} completions, "
                f"header generations={header.generation.generations}"
            )


@dataclass(frozen=True)
class EvalSummary:
    """What `counterpoint eval` prints: shares of completions/items, as fractions in [0, 1]."""

    n_items: int
    n_completions: int
    pass_rate: float  # admitted completions / completions
    coverage: float  # items with >= 1 admitted completion / items
    unparseable_share: float  # completions with nothing to judge (EvalItem.unparseable) / completions
    mean_length: float  # generated tokens per completion

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def summarize(items: Sequence[EvalItem]) -> EvalSummary:
    n_completions = sum(i.generations for i in items)
    if not items or n_completions == 0:
        nan = float("nan")
        return EvalSummary(len(items), n_completions, nan, nan, nan, nan)
    return EvalSummary(
        n_items=len(items),
        n_completions=n_completions,
        pass_rate=sum(i.pass_count for i in items) / n_completions,
        coverage=sum(i.pass_count > 0 for i in items) / len(items),
        unparseable_share=sum(i.unparseable for i in items) / n_completions,
        mean_length=sum(sum(i.lengths) for i in items) / n_completions,
    )
