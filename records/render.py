"""What a round looks like to people: its summary (counts, rates, histograms), the transcript
(prompts and completions, markdown) and the group -> node tree (text), all from the node rows
(records/rows.py). Pure functions of the rows."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from records.rows import TREE_MODES


def _groups(rows: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["sibling_group"]].append(row)
    return dict(sorted(groups.items()))


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def rows_summary(
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
