"""Prompts per mode, rendered by pure functions from the grader's case and the parent node.

A case (`CodeExecTask.cases()`) carries `prompt_messages` = [system, user]: the system message
holds the role, the sandbox's limits and the answer format; the user message holds the task's
description and a preview of every data file. A mode adds one section to the user message:

- draft:   write a complete script from scratch;
- improve: the parent's script and its validation metric (never its test metric), asked for one
           focused change that should beat it;
- debug:   the parent's script, how it failed (status, exception) and the tail of its output,
           asked for a fixed complete script;

and every prompt ends with the output format: one fenced python block holding the whole script.

With a scaffold (search.scaffold on, a task carrying one: search/scaffold.py) the section also
shows the script's tail (what runs after the block) and the task's hint; improve/debug show the
parent's BLOCK (the rest of its script is the template), and the prompt ends with
BLOCK_INSTRUCTION instead: the assistant turn is forced to open with the template's head
(`assistant_prefix`, which the prompt does not repeat), so the policy writes the block only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from config.search import SearchConfig
from search.scaffold import Scaffold
from search.tree import Node

FORMAT_INSTRUCTION = (
    "Answer with the complete script in ONE ```python fenced block (no other code blocks). "
    "It must write `submission.csv` in the working directory."
)
BLOCK_INSTRUCTION = "Answer with your code only: it continues the script where it stops."
HEADINGS = {
    "draft": "## Your task: a first solution",
    "improve": "## Your task: improve this solution",
    "debug": "## Your task: fix this failed solution",
}
FAILURES = {
    "no_code": "the answer held no ```python code block, so nothing ran",
    "crashed": "the script stopped with an error",
    "timeout": "the script was killed at the time limit",
    "invalid_submission": "the script ran but its submission.csv could not be graded",
}


def fenced(text: str, lang: str = "") -> str:
    """`text` in a fence longer than any backtick run inside it (shown verbatim)."""
    longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def clip_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 2
    cut = len(text) - limit
    return f"{text[:head]}\n# ... [{cut} characters cut] ...\n{text[len(text) - (limit - head):]}"


def _metric_line(case: Mapping[str, Any], value: float) -> str:
    task = case.get("task", {})
    metric, direction = task.get("metric", "metric"), task.get("direction", "higher")
    return (f"Its validation {metric} was {value:.6g} ({direction} is better). Make one focused "
            f"change that should {'raise' if direction == 'higher' else 'lower'} it, and keep "
            f"everything that already works.")


def _with_section(case: Mapping[str, Any], section: str,
                  scaffold: Scaffold | None = None) -> list[dict[str, str]]:
    messages = [dict(m) for m in case["prompt_messages"]]
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"case {case.get('id')!r}: prompt_messages must end with a user message")
    if scaffold is None:
        tail = FORMAT_INSTRUCTION
    else:
        heading, _, rest = section.partition("\n")
        hint = f"\n\n{scaffold.hint}" if scaffold.hint else ""
        section = (f"{heading}\n\nThe script is written for you (imports, data, features) up to "
                   f"your code; after your code it runs:\n\n{fenced(scaffold.tail, 'python')}"
                   f"{hint}\n{rest}")
        tail = BLOCK_INSTRUCTION
    messages[-1]["content"] = f"{messages[-1]['content'].rstrip()}\n\n{section.rstrip()}\n\n{tail}"
    return messages


def parent_block(parent: Node, scaffold: Scaffold) -> str:
    """The block a scaffolded parent wrote (its sampled text cut at the scaffold's stop), after
    the head's unfinished last line (`model = ` when the head ends in one)."""
    return scaffold.head.rsplit("\n", 1)[-1] + scaffold.block(parent.raw_completion)


def draft_prompt(case: Mapping[str, Any], scaffold: Scaffold | None = None) -> list[dict[str, str]]:
    if scaffold is not None:
        return _with_section(case, f"{HEADINGS['draft']}\n\nWrite the block.", scaffold)
    return _with_section(case, f"{HEADINGS['draft']}\n\nWrite a complete script that trains a "
                               "model on the training data and predicts every row of the test data.")


def improve_prompt(case: Mapping[str, Any], parent: Node, cfg: SearchConfig,
                   scaffold: Scaffold | None = None) -> list[dict[str, str]]:
    if parent.is_buggy or parent.result.val_metric is None and cfg.select_on == "val":
        raise ValueError(f"improve needs a valid parent with a validation metric, got {parent.id} "
                         f"({parent.result.status})")
    value = parent.result.val_metric if cfg.select_on == "val" else parent.result.test_metric
    if scaffold is not None:
        shown, what = parent_block(parent, scaffold), "This block"
    else:
        shown, what = parent.result.code, ""
    code = clip_middle(shown, cfg.max_parent_code_chars)
    lead = f"{what} was run in the template.\n\n" if what else ""
    return _with_section(case, f"{HEADINGS['improve']}\n\n{lead}{fenced(code, 'python')}\n\n"
                               f"{_metric_line(case, value)}", scaffold)


def debug_prompt(case: Mapping[str, Any], parent: Node, cfg: SearchConfig,
                 scaffold: Scaffold | None = None) -> list[dict[str, str]]:
    if not parent.is_buggy:
        raise ValueError(f"debug needs a failed parent, got {parent.id} (ok)")
    why = FAILURES.get(parent.result.status, f"status {parent.result.status}")
    if parent.result.exc_type:
        why += f" ({parent.result.exc_type})"
    if parent.result.message:
        why += f": {parent.result.message}"
    parts = [HEADINGS["debug"], ""]
    if scaffold is not None:
        parts += ["This block was run in the template:", "",
                  fenced(clip_middle(parent_block(parent, scaffold), cfg.max_parent_code_chars), "python"), ""]
    elif parent.result.code.strip():
        parts += [fenced(clip_middle(parent.result.code, cfg.max_parent_code_chars), "python"), ""]
    else:
        parts += ["Previous answer (no script was found in it):", "",
                  fenced(clip_middle(parent.raw_completion, cfg.max_parent_code_chars)), ""]
    parts.append(f"It failed: {why}.")
    tail = parent.result.term_tail[-cfg.debug_tail_chars:] if cfg.debug_tail_chars else ""
    if tail.strip():
        parts += ["", "Last lines of its output:", "", fenced(tail)]
    parts += ["", "Find the cause and return the corrected block." if scaffold is not None
              else "Find the cause and return the whole corrected script."]
    return _with_section(case, "\n".join(parts), scaffold)


def render_prompt(mode: str, case: Mapping[str, Any], parent: Node | None,
                  cfg: SearchConfig, scaffold: Scaffold | None = None) -> list[dict[str, str]]:
    """The prompt of an expansion in `mode` (parent None for a draft); with `scaffold`, the
    block-only prompt (its assistant turn opens with scaffold.prefix)."""
    if mode == "draft":
        return draft_prompt(case, scaffold)
    if parent is None:
        raise ValueError(f"{mode} prompt needs a parent node")
    if mode == "improve":
        return improve_prompt(case, parent, cfg, scaffold)
    if mode == "debug":
        return debug_prompt(case, parent, cfg, scaffold)
    raise ValueError(f"mode must be draft|improve|debug, got {mode!r}")


def mode_of(messages: Sequence[Mapping[str, str]]) -> str | None:
    """Which mode rendered these messages (for scripted policies and archive readers)."""
    text = messages[-1]["content"] if messages else ""
    for mode, heading in HEADINGS.items():
        if heading in text:
            return mode
    return None
