"""Held-out pass rate: sample completions for held-out cases on the rollout service and score
them on the grader service. Used before and after training (`counterpoint train`) and by
`counterpoint eval`.

A train run keeps both evals as EVAL.jsonl files in its run directory (heldout_before.jsonl,
heldout_after.jsonl) and reports after − before as one seed's paired difference with a 95 %
bootstrap interval over items (`heldout_section`, the computation of `compare --paired`)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from config.run import TrainerConfig
from evals.eval_file import CODE_EXEC_STYLE
from rollout.types import Prompt, Sample, SamplingParams

_TRAINER = TrainerConfig()  # the schema's defaults: declared there, read here


@dataclass
class HeldoutResult:
    adapter_version: int
    cases: list[Any]
    prompts: list[Prompt]  # per completion
    samples: list[Sample]  # per completion, prompt order
    scores: list[Any]  # per completion
    generations: int
    completions: list[str] | None = None  # what was scored, when not prefix + text (a scaffold)

    def items(self) -> list[Any]:
        """One EVAL.jsonl item per case (evals/eval_file.py owns the statistics); an opening the
        grader's Score lacks is the case's task's to parse (graders/tasks.py TaskProfile)."""
        from evals.eval_file import item_record
        from graders.tasks import task_profile

        g = self.generations
        out = []
        for i, case in enumerate(self.cases):
            prompts, samples = self.prompts[i * g:(i + 1) * g], self.samples[i * g:(i + 1) * g]
            texts = (self.completions[i * g:(i + 1) * g] if self.completions is not None
                     else [p.assistant_prefix + s.text for p, s in zip(prompts, samples)])
            scores = self.scores[i * g:(i + 1) * g]
            # code-exec drafts (completions given: the scripts as run) record each script's status
            out.append(item_record(
                case.id, texts, [len(s.token_ids) for s in samples], scores, len(case.openings),
                statuses=[s.status for s in scores] if self.completions is not None else None,
                opening_of=task_profile(getattr(case, "task", "")).opening_of))
        return out

    def summary(self) -> dict[str, float]:
        from evals.eval_file import summarize

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
                     adapter_version: int, prefix_mode: str = _TRAINER.prefix_mode) -> HeldoutResult:
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


# ---------------------------------------------------------------- tree mode (code-exec tasks)
@dataclass(frozen=True)
class TestRowsScore:
    """A code-exec grade as an EVAL.jsonl completion: admitted = a valid submission (status ok);
    reward = the TEST rows' metric through the task's reward map, the sentinel for a failed
    script. Never the validation rows, which choose nodes and give the training reward.
    ``status`` is the script's (the item's ``statuses``)."""

    admitted: bool
    verdict: str
    reward: float
    status: str


def test_rows_score(score: Any, metric: str, sentinel: float, task: str) -> TestRowsScore:
    """``task`` (the case's grader task) maps the test metric to a reward (TaskProfile.test_reward)."""
    from graders.tasks import task_profile

    ok = score.status == "ok" and score.test_metric is not None
    reward = task_profile(task).test_reward(metric, float(score.test_metric)) if ok else float(sentinel)
    return TestRowsScore(admitted=ok, verdict=str(score.status), reward=float(reward), status=str(score.status))


def evaluate_tree_heldout(grader: Any, rollout: Any, cases: Sequence[Any], params: SamplingParams,
                          adapter_version: int, search_cfg: Any, sentinel: float) -> HeldoutResult:
    """`params.n` DRAFT completions per code-exec case (a task: its test rows are held out from
    training and selection), rendered as a tree round renders a draft (search.prompts; with
    search.scaffold the template's head forced and its block written), scored on the grader
    and kept as TestRowsScore (valid share = pass rate; mean test reward)."""
    from search.prompts import render_prompt
    from search.scaffold import scaffold_of

    g = params.n
    prompts, scaffolds = [], []
    for case in cases:
        cd = {"id": case.id, "prompt_messages": [dict(m) for m in case.messages], "task": dict(case.details)}
        sc = scaffold_of(cd["task"]) if search_cfg.scaffold else None
        if search_cfg.scaffold and sc is None:
            raise ValueError(f"search.scaffold is on but task {case.id!r} has no scaffold in its task.json")
        messages = tuple(render_prompt("draft", cd, None, search_cfg, sc))
        prompts += [Prompt(messages, sc.prefix if sc else "")] * g
        scaffolds += [sc] * g
    stop = tuple(dict.fromkeys(x for sc in scaffolds if sc for x in sc.stop))
    single = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids,
                            seed=params.seed, stop=stop)
    samples = sorted(rollout.generate(prompts, single, adapter_version), key=lambda s: s.prompt_index)
    texts = [sc.completion(s.text) if sc else p.assistant_prefix + s.text
             for p, s, sc in zip(prompts, samples, scaffolds)]
    ids = [case.id for case in cases for _ in range(g)]
    raw = grader.score_batch(list(zip(ids, texts)))
    metric = {case.id: case.details["metric"] for case in cases}
    task = {case.id: case.task for case in cases}
    scores = [test_rows_score(r, metric[i], sentinel, task[i]) for r, i in zip(raw, ids)]
    return HeldoutResult(adapter_version, list(cases), prompts, samples, scores, g, completions=texts)


def mean_reward_difference(before: Any, after: Any, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """after - before of the per-item mean reward (items paired by id), with a 95 % percentile
    bootstrap interval over items (evals/compare.py bootstrap_difference, paired)."""
    import numpy as np

    from evals.compare import bootstrap_difference

    b = {i.item_id: float(np.mean(i.rewards)) for i in before.items}
    a = {i.item_id: float(np.mean(i.rewards)) for i in after.items}
    ids = sorted(set(a) & set(b))
    base, arm = np.array([[b[k] for k in ids]]), np.array([[a[k] for k in ids]])
    reps = bootstrap_difference(base, arm, paired=True, n_boot=n_boot, seed=seed)
    low, high = np.percentile(reps, [2.5, 97.5])
    return {"before": float(base.mean()), "after": float(arm.mean()), "difference": float(arm.mean() - base.mean()),
            "low": float(low), "high": float(high), "n_items": len(ids),
            "per_item": {k: {"before": b[k], "after": a[k]} for k in ids}}


def per_task_reward_differences(before: Any, after: Any, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per item (a code-exec task): after - before of its mean test reward, with a 95 % percentile
    bootstrap interval over its completions (before's and after's resampled independently: they
    are separate draws). With a handful of tasks the interval over tasks says little; this one
    says whether the policy got better on each task, its held-out test rows included."""
    import numpy as np

    from evals.compare import bootstrap_difference

    b = {i.item_id: i.rewards for i in before.items}
    a = {i.item_id: i.rewards for i in after.items}
    out = {}
    for k in sorted(set(a) & set(b)):
        if len(a[k]) != len(b[k]) or not a[k]:
            continue  # different generation counts: no shared resampling axis
        reps = bootstrap_difference(np.array([b[k]], float), np.array([a[k]], float), paired=False,
                                    n_boot=n_boot, seed=seed)
        low, high = np.percentile(reps, [2.5, 97.5])
        out[k] = {"before": float(np.mean(b[k])), "after": float(np.mean(a[k])),
                  "difference": float(np.mean(a[k]) - np.mean(b[k])), "low": float(low), "high": float(high),
                  "completions": len(a[k])}
    return out


# ---------------------------------------------------------------- a train run's before/after
def prompts_digest(result: HeldoutResult) -> str:
    """prompts_sha256 of the rendered prompts (messages + forced prefix per completion)."""
    from evals.eval_file import prompts_sha256

    g = result.generations
    return prompts_sha256({
        case.id: [[list(p.messages), p.assistant_prefix] for p in result.prompts[i * g:(i + 1) * g]]
        for i, case in enumerate(result.cases)
    })


def write_heldout_eval(path: Path, result: HeldoutResult, params: SamplingParams, *, model: str,
                       voices: int, eos_token_ids: Sequence[int], prefix_mode: str,
                       fixture_source: str | None, scoring: Any = None, run: str | None = None) -> Path:
    """Keep a train run's held-out eval as an EVAL.jsonl (per-item results + the header that
    `counterpoint compare` checks), so before and after can be paired item by item."""
    from evals.eval_file import GenerationSettings, header_for, write_eval

    items = result.items()
    header = header_for(
        items, generation=GenerationSettings.from_sampling_params(params, eos_token_ids), model=model,
        voices=voices, split="heldout", fixture_source=fixture_source, prompts_sha256=prompts_digest(result),
        prefix_mode=prefix_mode, adapter=f"rollout adapter v{result.adapter_version}", run=run,
        scoring=scoring)
    return write_eval(path, header, items)


# The config keys `counterpoint replicate` sets itself for every arm, refused in its --set and
# --grid (services/replicate.py) and left out of the replicate command printed for a run.
REPLICATE_OWNS = {"seed": "the seed is --seeds", "run_name": "replicate names each arm",
                  "trainer.runs_dir": "replicate places each arm under --out",
                  "eval.seed": "each arm's eval samples with the arm's seed",
                  "eval.before_and_after": "replicate evaluates every flat arm before and after training "
                                           "(a tree cell takes it from the config file)"}


def replicate_command(argv: Sequence[str], seed: int, n_seeds: int = 5, out: str = "runs/replicate") -> list[str]:
    """The commands that put an interval across seeds on this run's gain: `counterpoint replicate`
    with the same config and overrides (seed and naming left to replicate), then `compare --paired`
    of one arm's before-eval against every arm's after-eval. ``argv`` is the train command's."""
    config, sets = "<config.yaml>", []
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        value = args[i + 1]
        if arg in ("--config", "-c"):
            config = value
        elif arg == "--set" and value.split("=", 1)[0].strip() not in REPLICATE_OWNS:
            sets += ["--set", value]
    for arg in args:
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    seeds = [seed + k for k in range(n_seeds)]  # (a resumed run's argv has no --config: a placeholder)
    first = f"{out}/runs/seed{seeds[0]}"
    return [
        shlex.join(["counterpoint", "replicate", "--config", config, "--seeds", ",".join(map(str, seeds)),
                    "--out", out, *sets]).replace("'<config.yaml>'", "<config.yaml>"),
        f"counterpoint compare {first}/heldout_before.jsonl {out}/runs/seed*/heldout_after.jsonl --paired",
    ]


def heldout_section(before: Path, after: Path, seed: int, argv: Sequence[str], n_boot: int = 2000,
                    trained_on: Sequence[str] | None = None) -> dict[str, Any]:
    """run.json's ``heldout``: each eval's summary and file, and after − before as one seed's
    paired difference with a 95 % bootstrap interval over items (evals/compare.py, the same
    computation as `counterpoint compare --paired`). Read from the files, so a resumed run pairs
    the after-eval with the before-eval its first attempt wrote (RunDir.heldout_path)."""
    from evals.compare import compare
    from evals.eval_file import read_eval, summarize

    section: dict[str, Any] = {}
    evals = {}
    for when, path in (("before", Path(before)), ("after", Path(after))):
        if path.is_file():
            evals[when] = read_eval(path)
            section[when] = {"summary": summarize(evals[when].items).as_dict(), "eval_file": str(path)}
    if len(evals) < 2:
        return section
    result = compare([evals["before"]], [evals["after"]], paired=True, n_boot=n_boot, seed=0)
    section["difference"] = {
        "statistic": "after - before, percentage points",
        **{m.metric: {"before": m.base_mean, "after": m.arm_mean, "difference": m.difference,
                      "low": m.low, "high": m.high} for m in result.metrics.values()},
        "interval": "95% percentile bootstrap over items, paired",
        "n_items": result.n_items, "n_boot": result.n_boot, "bootstrap_seed": result.seed,
        "method": result.method, "warnings": result.warnings,
        "scope": f"one seed's result (seed {seed}): the interval covers item sampling only, not "
                 "seed-to-seed variation",
        "across_seeds": replicate_command(argv, seed),
    }
    styles = {e.header.scoring.style if e.header.scoring else None for e in evals.values()}
    if styles == {CODE_EXEC_STYLE}:  # code-exec: pass rate = valid share; and the test reward
        section["difference"]["test_reward"] = {
            "statistic": "after - before of the mean test-rows reward (reward map of the task's "
                         "metric on the TEST rows, sentinel for a failed script), reward units",
            **mean_reward_difference(evals["before"], evals["after"], n_boot=n_boot),
            "per_task": per_task_reward_differences(evals["before"], evals["after"], n_boot=n_boot),
            "trained_on": sorted(trained_on) if trained_on is not None else None}
    return section


def heldout_table(section: dict[str, Any]) -> Any:
    """One rich table, a row per eval (before, after) of run.json's ``heldout`` section."""
    from rich.table import Table

    table = Table(title="held-out eval, before and after training")
    for col in ("", "items", "completions", "pass rate", "coverage", "unparseable", "mean len"):
        table.add_column(col, justify="left" if not col else "right", no_wrap=True)
    for when in ("before", "after"):
        if when in section:
            s = section[when]["summary"]
            table.add_row(when, str(s["n_items"]), str(s["n_completions"]),
                          f"{s['pass_rate'] * 100:.2f} %", f"{s['coverage'] * 100:.2f} %",
                          f"{s['unparseable_share'] * 100:.2f} %", f"{s['mean_length']:.1f}")
    return table


def heldout_lines(section: dict[str, Any]) -> list[str]:
    """after − before in words: the paired interval, that it is one seed's result, and the
    commands for the interval across seeds. Empty without both evals."""
    d = section.get("difference")
    if d is None:
        return []
    p = d["pass_rate"]
    r = d.get("test_reward")
    return [
        f"held-out pass rate, after - before: {p['difference']:+.2f} points, 95% interval "
        f"[{p['low']:+.2f}, {p['high']:+.2f}] (paired bootstrap over {d['n_items']} items, B={d['n_boot']})",
        *([f"held-out test-rows reward, after - before: {r['difference']:+.4f} ({r['before']:+.4f} -> "
           f"{r['after']:+.4f}), 95% interval [{r['low']:+.4f}, {r['high']:+.4f}] (paired bootstrap "
           f"over {r['n_items']} tasks)"] if r else []),
        *_per_task_lines(r),
        f"This is {d['scope']}. For an interval across seeds:",
        *(f"  {command}" for command in d["across_seeds"]),
    ]


def _per_task_lines(test_reward: dict[str, Any] | None) -> list[str]:
    """One line per task: its test-rows reward before -> after with the interval over completions."""
    if not test_reward or not test_reward.get("per_task"):
        return []
    trained = test_reward.get("trained_on")
    lines = []
    for task, t in test_reward["per_task"].items():
        tag = "" if trained is None else (" (trained on)" if task in trained else " (not trained on)")
        lines.append(f"  {task}{tag}: {t['before']:+.3f} -> {t['after']:+.3f}, {t['difference']:+.3f}, 95% "
                     f"interval [{t['low']:+.3f}, {t['high']:+.3f}] over {t['completions']}+{t['completions']} completions")
    return lines
