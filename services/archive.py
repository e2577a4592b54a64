"""The run directory (DESIGN.md "Run directory") and the rollout archive.

```
runs/<run>/run.json            receipt (services/receipt.py)
runs/<run>/timing.jsonl        one line per TRAINED step: {"step", "total_s", "phases_s"}
runs/<run>/metrics.jsonl       one line per trained step: {"step", <every scalar metric>}
runs/<run>/round_<step>/       <task>__<epoch>.jsonl             one row per completion/node
                               <task>__<epoch>__transcript.md    readable prompts + completions
                               <task>__<epoch>__tree.txt         group -> node tree with rewards
                               <task>__summary_<epoch>.json      counts, rates, histograms
runs/<run>/heldout_before.jsonl, heldout_after.jsonl   EVAL.jsonl of the held-out eval before and
                               after training (evals/records.py), with per-item results
runs/<run>/adapters/init/, adapters/step_<N>/, checkpoints/step_<N>/
runs/<run>/superseded/attempt_<n>/   what a resume re-runs, as the dead attempt left it
```

Commit order of a step: write its round as soon as it is generated and scored (before the
learner trains on it), then ``append_metrics``, then ``append_timing`` last. The timing line is
the commit point: a step is trained iff timing.jsonl has its line, so a round written for a step
that never finished shows up in ``untrained_rounds()``.

Nothing a run produced is deleted. JSONL files survive a SIGKILL mid-write: a record is committed
once its trailing newline is on disk. On resume, ``recover()`` cuts a torn last line (an
incomplete record) and ``supersede_after(step)`` moves everything recorded after the checkpoint
the run resumes from (rounds, metrics and timing lines, adapters, checkpoints) into
``superseded/attempt_<n>/`` with a ``superseded.json`` saying what and why: the main tree then
holds each step once, and the dead attempt's rollouts stay readable beside it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from search.rows import TREE_FIELDS
from services.step_timer import PHASES


NODE_FIELDS = (
    "id",
    "step",
    "round",
    "exp_id",
    "parent_id",
    "sibling_group",
    "mode",
    "prompt_messages",
    "assistant_prefix",
    "prompt_token_ids",
    "raw_completion",
    "response_token_ids",
    "response_logprobs",
    "adapter_version",
    "status",
    "is_buggy",
    "verdict",
    "failing_rules",
    "test_metric",
    "reward",
    "advantage",
    "exec_time",
    "n_children",
)

NodeMode = Literal["sample", "draft", "improve", "debug"]
TREE_MODES = ("draft", "improve", "debug")
# Tree rows (modes draft|improve|debug) carry NODE_FIELDS and then search.rows.TREE_FIELDS
# (expansion, debug_depth, val_metric, oriented, code, plan, thinking, term_tail, limits, ...).
TREE_NODE_FIELDS = (*NODE_FIELDS, *TREE_FIELDS)


class ArchiveError(ValueError):
    """Bad input to the archive, or a run directory that is corrupt beyond a torn last line."""


# --------------------------------------------------------------------------- JSONL


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def repair_jsonl(path: Path) -> int:
    """Cut a torn last line (no trailing newline) off ``path``; return bytes dropped."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1  # 0 when the only line is torn
    with open(path, "r+b") as fh:
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data) - keep


def append_jsonl(path: Path, record: Mapping[str, Any]) -> None:
    """Append one record as one line, durably. A torn tail left by a crash is cut first, so a
    new record never glues onto half a line."""
    line = json.dumps(record, allow_nan=True, separators=(",", ":")) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    repair_jsonl(path)
    with open(path, "ab") as fh:
        fh.write(line.encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Committed records of ``path`` (a torn last line is ignored, not an error). A bad line
    anywhere else is corruption and raises, naming the file and line."""
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    lines.pop()  # "" after the final newline, or the torn (uncommitted) last line
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ArchiveError(f"{path}:{number}: not a JSON line ({err.msg})") from None
    return records


# --------------------------------------------------------------------------- node rows


def node_id(step: int, sibling_group: int, index: int, round: int = 0) -> str:
    """Stable node id: ``s<step>-r<round>-g<group>-<index>``."""
    return f"s{step}-r{round}-g{sibling_group}-{index}"


def node_row(
    *,
    id: str,
    step: int,
    exp_id: str,
    sibling_group: int,
    prompt_messages: Sequence[Mapping[str, str]],
    assistant_prefix: str,
    prompt_token_ids: Sequence[int],
    raw_completion: str,
    response_token_ids: Sequence[int],
    response_logprobs: Sequence[float],
    adapter_version: int,
    status: str,
    verdict: str | None,
    failing_rules: Sequence[str],
    reward: float | None,
    advantage: float | None,
    is_buggy: bool | None = None,
    round: int = 0,
    parent_id: str | None = None,
    mode: NodeMode = "sample",
    test_metric: float | None = None,
    exec_time: float | None = None,
    n_children: int = 0,
    tree: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One archived completion/node with exactly the DESIGN.md node-row fields.

    What the model saw and wrote: ``prompt_token_ids`` are the tokens the engine was conditioned
    on (``prompt_messages`` through the chat template with the generation prompt, then the forced
    ``assistant_prefix``; rollout.engines.base.render_prompt), ``response_token_ids`` the sampled
    tokens after them with their rollout log-probs, and ``raw_completion`` the decoded sampled
    text only. The grader scored ``assistant_prefix + raw_completion``.

    Flat GRPO: mode "sample", round 0, parent_id None, sibling_group = the prompt's group index
    in the step, n_children 0. ``status`` says what happened to the completion ("ok",
    "truncated", "grader_error", ...); ``is_buggy`` is True when the completion failed to be
    scored at all (None = unknown), ``exec_time`` the grader's seconds for it.
    """
    if mode not in ("sample", "draft", "improve", "debug"):
        raise ArchiveError(f"node mode must be sample|draft|improve|debug, got {mode!r}")
    if (mode in TREE_MODES) != (tree is not None) or tree is not None and set(tree) != set(TREE_FIELDS):
        raise ArchiveError(f"node {id}: a {mode} row needs exactly the tree fields {list(TREE_FIELDS)} "
                           f"(tree rows only), got {sorted(tree or {})}")
    if not prompt_token_ids:
        raise ArchiveError(f"node {id}: no prompt_token_ids (what the model was conditioned on)")
    if len(response_logprobs) != len(response_token_ids):
        raise ArchiveError(
            f"node {id}: {len(response_token_ids)} response tokens but "
            f"{len(response_logprobs)} log-probs"
        )
    return {
        "id": id,
        "step": step,
        "round": round,
        "exp_id": exp_id,
        "parent_id": parent_id,
        "sibling_group": sibling_group,
        "mode": mode,
        "prompt_messages": [dict(m) for m in prompt_messages],
        "assistant_prefix": assistant_prefix,
        "prompt_token_ids": [int(t) for t in prompt_token_ids],
        "raw_completion": raw_completion,
        "response_token_ids": [int(t) for t in response_token_ids],
        "response_logprobs": [float(x) for x in response_logprobs],
        "adapter_version": adapter_version,
        "status": status,
        "is_buggy": is_buggy,
        "verdict": verdict,
        "failing_rules": list(failing_rules),
        "test_metric": test_metric,
        "reward": None if reward is None else float(reward),
        "advantage": None if advantage is None else float(advantage),
        "exec_time": exec_time,
        "n_children": n_children,
        **{k: (tree or {})[k] for k in (TREE_FIELDS if tree is not None else ())},
    }


def check_node_rows(rows: Iterable[Mapping[str, Any]]) -> None:
    """Flat rows (mode sample) hold exactly NODE_FIELDS; tree rows exactly TREE_NODE_FIELDS."""
    for i, row in enumerate(rows):
        keys = set(row)
        expected = set(TREE_NODE_FIELDS if row.get("mode") in TREE_MODES else NODE_FIELDS)
        if keys != expected:
            missing, extra = sorted(expected - keys), sorted(keys - expected)
            raise ArchiveError(f"node row {i}: missing fields {missing}, unexpected fields {extra}")


# --------------------------------------------------------------------------- round renderings


def _groups(rows: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["sibling_group"]].append(row)
    return dict(sorted(groups.items()))


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def round_summary(
    rows: Sequence[Mapping[str, Any]], pass_verdicts: Collection[str] = ("admitted",)
) -> dict[str, Any]:
    """Counts and rates of one round. ``pass_verdicts``: verdicts that count as a pass."""
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    groups = _groups(rows)
    zero_std = [
        len({r["reward"] for r in group}) == 1
        for group in groups.values()
        if all(r["reward"] is not None for r in group)
    ]
    return {
        "rows": len(rows),
        "groups": len(groups),
        "status_counts": dict(Counter(r["status"] for r in rows)),
        "mode_counts": dict(Counter(r["mode"] for r in rows)),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "pass_rate": (
            sum(r["verdict"] in pass_verdicts for r in rows) / len(rows) if rows else None
        ),
        "verdict_histogram": dict(Counter(str(r["verdict"]) for r in rows).most_common()),
        "failing_rule_histogram": dict(
            Counter(f for r in rows for f in r["failing_rules"]).most_common()
        ),
        "frac_reward_zero_std": sum(zero_std) / len(zero_std) if zero_std else None,
        "adapter_versions": sorted({r["adapter_version"] for r in rows}),
    }


def _fenced(text: str) -> list[str]:
    # A fence longer than any backtick run inside, so a completion is shown verbatim (CommonMark).
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence]


def _message_text(messages: Sequence[Mapping[str, str]]) -> str:
    return "\n\n".join(f"**{m.get('role', '?')}**: {m.get('content', '')}" for m in messages)


def render_transcript(step: int, task: str, epoch: int, rows: Sequence[Mapping[str, Any]]) -> str:
    out = [f"# Step {step} — {task}, epoch {epoch}", ""]
    for group, members in _groups(rows).items():
        out += [f"## Group {group}", "", _message_text(members[0]["prompt_messages"]), ""]
        for row in members:
            rules = ", ".join(row["failing_rules"]) or "none"
            prefix = row["assistant_prefix"]
            forced = ["forced assistant prefix (not sampled):", "", *_fenced(prefix), ""] if prefix else []
            out += [
                f"### {row['id']} — reward {_fmt(row['reward'])}, verdict `{row['verdict']}`, "
                f"advantage {_fmt(row['advantage'], signed=True)}",
                "",
                f"status {row['status']}, adapter v{row['adapter_version']}, "
                f"mode {row['mode']}, failing rules: {rules}, "
                f"{len(row['prompt_token_ids'])} prompt + {len(row['response_token_ids'])} response tokens",
                "",
                *_tree_lines(row),
                *forced,
                *_fenced(row["raw_completion"]),
                "",
            ]
    return "\n".join(out)


def _tree_lines(row: Mapping[str, Any]) -> list[str]:
    if row["mode"] not in TREE_MODES:
        return []
    lines = [f"parent {row['parent_id'] or '-'}, {'ok' if not row['is_buggy'] else 'BUGGY'}, "
             f"val {_fmt(row['val_metric'])}, test {_fmt(row['test_metric'])}, "
             f"exec {_fmt(row['exec_time'])} s, exception {row['exc_type'] or '-'}", ""]
    if row["is_buggy"] and row["term_tail"]:
        lines += ["output tail:", "", *_fenced(row["term_tail"][-1000:]), ""]
    return lines


def render_tree(step: int, task: str, epoch: int, rows: Sequence[Mapping[str, Any]]) -> str:
    """ASCII tree: group -> nodes (children nested under their parent_id)."""
    children: dict[str | None, list[Mapping[str, Any]]] = defaultdict(list)
    ids = {row["id"] for row in rows}
    for row in rows:
        parent = row["parent_id"] if row["parent_id"] in ids else None
        children[parent].append(row)

    def label(row: Mapping[str, Any]) -> str:
        if row["mode"] in TREE_MODES:  # mode, ok/BUGGY and the test value (mle-tree-spec.md)
            parent = row["parent_id"]
            outside = f" (parent {parent})" if parent is not None and parent not in ids else ""
            return (
                f"{row['id']} [{row['mode']}] {'ok' if not row['is_buggy'] else 'BUGGY'} "
                f"{row['status']} test {_fmt(row['test_metric'])} reward {_fmt(row['reward'])} "
                f"adv {_fmt(row['advantage'], signed=True)}{outside}"
            )
        return (
            f"{row['id']} [{row['mode']}] reward {_fmt(row['reward'])} "
            f"adv {_fmt(row['advantage'], signed=True)} {row['verdict']}"
        )

    def walk(node: Mapping[str, Any], prefix: str, last: bool, out: list[str]) -> None:
        out.append(f"{prefix}{'└── ' if last else '├── '}{label(node)}")
        kids = children.get(node["id"], [])
        for i, kid in enumerate(kids):
            walk(kid, prefix + ("    " if last else "│   "), i == len(kids) - 1, out)

    out = [f"step {step}  task {task}  epoch {epoch}"]
    groups = _groups(children[None])
    for gi, (group, roots) in enumerate(groups.items()):
        last_group = gi == len(groups) - 1
        members = [r for r in rows if r["sibling_group"] == group]
        rewards = [r["reward"] for r in members if r["reward"] is not None]
        mean = statistics.fmean(rewards) if rewards else None
        out.append(f"{'└── ' if last_group else '├── '}group {group}  mean reward {_fmt(mean)}")
        for i, root in enumerate(roots):
            walk(root, "    " if last_group else "│   ", i == len(roots) - 1, out)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- run directory


class RunDir:
    """Paths and records of one run directory ``runs/<run_name>/``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # paths
    @property
    def receipt_path(self) -> Path:
        return self.root / "run.json"

    @property
    def timing_path(self) -> Path:
        return self.root / "timing.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def curves_path(self) -> Path:
        return self.root / "curves.png"

    @property
    def init_adapter_dir(self) -> Path:
        return self.root / "adapters" / "init"

    def adapter_dir(self, step: int) -> Path:
        return self.root / "adapters" / f"step_{step}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}"

    def heldout_path(self, when: Literal["before", "after"]) -> Path:
        """EVAL.jsonl of the held-out eval ``before`` or ``after`` training."""
        if when not in ("before", "after"):
            raise ArchiveError(f"held-out eval is 'before' or 'after', got {when!r}")
        return self.root / f"heldout_{when}.jsonl"

    def round_dir(self, step: int) -> Path:
        return self.root / f"round_{step}"

    def tree_path(self, step: int) -> Path:
        """The search tree after step ``step``'s round (tree mode; what search.carry_tree continues)."""
        return self.round_dir(step) / "tree.json"

    def round_paths(self, step: int, task: str, epoch: int) -> dict[str, Path]:
        base = self.round_dir(step)
        return {
            "rows": base / f"{task}__{epoch}.jsonl",
            "transcript": base / f"{task}__{epoch}__transcript.md",
            "tree": base / f"{task}__{epoch}__tree.txt",
            "summary": base / f"{task}__summary_{epoch}.json",
        }

    def create(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    # step records
    def recover(self) -> dict[str, int]:
        """Make the directory consistent after a crash (call on resume): cut torn last lines.
        Metrics lines of steps without a timing line stay until ``supersede_after`` moves them
        (they are after every trained step). Returns what was cut and what is uncommitted."""
        torn_timing = repair_jsonl(self.timing_path)
        torn_metrics = repair_jsonl(self.metrics_path)
        trained = set(self.trained_steps())
        uncommitted = [m for m in read_jsonl(self.metrics_path) if m.get("step") not in trained]
        return {
            "timing_torn_bytes": torn_timing,
            "metrics_torn_bytes": torn_metrics,
            "metrics_uncommitted_lines": len(uncommitted),
        }

    @property
    def superseded_root(self) -> Path:
        return self.root / "superseded"

    def supersede_after(self, step: int, reason: str = "resume") -> tuple[list[int], Path | None]:
        """Move what was recorded after ``step`` (a resume from step's checkpoint re-runs it) out
        of the main tree into ``superseded/attempt_<n>/``: timing and metrics lines of later
        steps, their round directories, adapters/step_* and checkpoints/step_* after ``step``.
        Returns (the trained steps moved, the attempt directory or None when nothing moved)."""
        dropped = [s for s in self.trained_steps() if s > step]
        moved: dict[str, list] = {"timing": [], "metrics": [], "rounds": [], "adapters": [], "checkpoints": []}
        kept_lines: dict[Path, list] = {}
        for name, path in (("timing", self.timing_path), ("metrics", self.metrics_path)):
            records = read_jsonl(path)
            kept_lines[path] = [r for r in records if int(r["step"]) <= step]
            moved[name] = [r for r in records if int(r["step"]) > step]
        later = lambda p: p.is_dir() and p.name.split("_")[-1].isdigit() and int(p.name.split("_")[-1]) > step
        dirs = {"rounds": [self.round_dir(s) for s in self.round_steps() if s > step],
                "adapters": sorted(p for p in (self.root / "adapters").glob("step_*") if later(p)),
                "checkpoints": sorted(p for p in (self.root / "checkpoints").glob("step_*") if later(p))}
        if not any(moved.values()) and not any(dirs.values()):
            return dropped, None
        self.superseded_root.mkdir(exist_ok=True)
        n = 1 + sum(1 for p in self.superseded_root.glob("attempt_*") if p.is_dir())
        attempt = self.superseded_root / f"attempt_{n}"
        attempt.mkdir()
        for name in ("timing", "metrics"):
            if moved[name]:
                _atomic_write_text(attempt / f"{name}.jsonl",
                                   "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in moved[name]))
        for kind, paths in dirs.items():
            for path in paths:
                dest = attempt / path.name if kind == "rounds" else attempt / kind / path.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest)
                moved[kind].append(path.name)
        _atomic_write_text(attempt / "superseded.json", json.dumps({
            "reason": reason, "resumed_from_step": step, "trained_steps": dropped,
            "uncommitted_steps": sorted({int(r["step"]) for r in moved["metrics"]} - set(dropped)),
            "rounds": moved["rounds"], "adapters": moved["adapters"], "checkpoints": moved["checkpoints"],
        }, indent=2) + "\n")
        # The main tree's lines last: a crash before this point leaves them (and a copy aside).
        for path, kept in kept_lines.items():
            if path.exists():
                _atomic_write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
        return dropped, attempt

    def append_timing(self, step: int, total_s: float, phases_s: Mapping[str, float]) -> None:
        """Commit step ``step`` as trained (write this last for the step)."""
        unknown = sorted(set(phases_s) - set(PHASES))
        if unknown:
            raise ArchiveError(
                f"unknown phase names {unknown}; DESIGN.md phases are {list(PHASES)}"
            )
        last = self.last_trained_step()
        if step <= last:
            raise ArchiveError(f"step {step} is not after the last trained step {last}")
        record = {
            "step": step,
            "total_s": float(total_s),
            "phases_s": {k: float(v) for k, v in phases_s.items()},
        }
        append_jsonl(self.timing_path, record)

    def append_metrics(self, step: int, metrics: Mapping[str, float | int | bool | None]) -> None:
        """Record every scalar metric of step ``step`` (before its timing line)."""
        bad = sorted(
            k for k, v in metrics.items() if v is not None and not isinstance(v, (int, float))
        )
        if bad:
            raise ArchiveError(f"metrics must be scalars; not scalar: {bad}")
        if "step" in metrics:
            raise ArchiveError("'step' is the record key, not a metric name")
        append_jsonl(self.metrics_path, {"step": step, **metrics})

    def timing(self) -> list[dict[str, Any]]:
        return read_jsonl(self.timing_path)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def trained_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.timing()})

    def last_trained_step(self) -> int:
        """0 when no step was trained; the next step to run is this + 1."""
        steps = self.trained_steps()
        return steps[-1] if steps else 0

    def metric_series(self) -> dict[str, int]:
        """Metric name -> number of points in metrics.jsonl (the receipt's ``metric_series``)."""
        counts: Counter[str] = Counter()
        for record in self.metrics():
            counts.update(k for k, v in record.items() if k != "step" and v is not None)
        return dict(sorted(counts.items()))

    # rounds
    def round_steps(self) -> list[int]:
        steps = []
        for path in self.root.glob("round_*"):
            suffix = path.name.removeprefix("round_")
            if path.is_dir() and suffix.isdigit():
                steps.append(int(suffix))
        return sorted(steps)

    def untrained_rounds(self) -> list[int]:
        """Steps with a round directory but no timing line (generated, never trained)."""
        trained = set(self.trained_steps())
        return [s for s in self.round_steps() if s not in trained]

    def write_round(
        self,
        step: int,
        task: str,
        epoch: int,
        rows: Sequence[Mapping[str, Any]],
        pass_verdicts: Collection[str] = ("admitted",),
        search_summary: Mapping[str, Any] | None = None,
        tree_json: str | None = None,
    ) -> dict[str, Path]:
        """Write the rollouts of one step: rows, transcript, tree and summary. Files are written
        whole (atomic replace), so re-running a step after a resume overwrites cleanly.
        Tree mode adds the search round's summary (its keys merged in; its ``task``, the case,
        as ``case``) and the tree itself as round_<step>/tree.json."""
        if not rows:
            raise ArchiveError(f"round {step}: no rows to write")
        check_node_rows(rows)
        wrong_step = sorted({r["step"] for r in rows if r["step"] != step})
        if wrong_step:
            raise ArchiveError(f"round {step}: rows carry other step numbers {wrong_step}")
        paths = self.round_paths(step, task, epoch)
        body = "".join(json.dumps(dict(r), separators=(",", ":")) + "\n" for r in rows)
        _atomic_write_text(paths["rows"], body)
        _atomic_write_text(paths["transcript"], render_transcript(step, task, epoch, rows))
        _atomic_write_text(paths["tree"], render_tree(step, task, epoch, rows))
        summary = {"step": step, "task": task, "epoch": epoch, **round_summary(rows, pass_verdicts)}
        if search_summary is not None:
            summary["case"] = search_summary.get("task")
            summary.update({k: v for k, v in search_summary.items() if k not in summary})
        _atomic_write_text(paths["summary"], json.dumps(summary, indent=2) + "\n")
        if tree_json is not None:
            paths["tree_json"] = self.tree_path(step)
            _atomic_write_text(paths["tree_json"], tree_json if tree_json.endswith("\n") else tree_json + "\n")
        return paths

    def read_round(self, step: int, task: str, epoch: int) -> list[dict[str, Any]]:
        return read_jsonl(self.round_paths(step, task, epoch)["rows"])
