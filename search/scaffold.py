"""The scaffold of a code-exec task: a template script whose one block the policy writes.

A small model does not write a whole working ML script from a bare prompt (the embedded 135M
model: 0/8 valid, bench/results/mle-tree-base.md). A task may therefore carry a `scaffold` in
its task.json (the bundled tasks ship one, graders/code_exec/build.py), sent to the driver with
the case's task details:

    {"head": "<the script up to the block>", "tail": "<the script after it>",
     "hint": "<what the block must do>", "stop": ["<strings that end the block>", ...]}

With search.scaffold on, a node's assistant turn opens with `prefix` = "```python\\n" + head
(forced, never sampled), the policy writes the block, generation stops at the first of `stop`
(or at max_tokens), and the script executed is head + block + tail, closed by a fence. The
prompt shows the template with the block marked; improve/debug prompts show the parent's BLOCK
(the rest is fixed) with its validation metric or its failure.

Pure functions: no model, no grader, no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN_FENCE = "```python\n"
CLOSE_FENCE = "```"
BLOCK_MARK = "# <<< YOUR BLOCK >>>"
DEFAULT_STOP = (CLOSE_FENCE,)


class ScaffoldError(ValueError):
    """A task's scaffold is malformed (one-line message naming what)."""


@dataclass(frozen=True)
class Scaffold:
    head: str
    tail: str
    hint: str = ""
    stop: tuple[str, ...] = DEFAULT_STOP

    @property
    def prefix(self) -> str:
        """The forced opening of the assistant turn: the fence and the head."""
        return OPEN_FENCE + self.head

    def template(self) -> str:
        """The whole script with the block marked, as the prompt shows it."""
        if self.head.endswith("\n"):
            return f"{self.head}{BLOCK_MARK}\n{self.tail}"
        return f"{self.head}<YOUR CODE>  {BLOCK_MARK}\n{self.tail}"  # the block continues a line

    def block(self, text: str) -> str:
        """The block a sampled `text` holds: cut at the first stop string."""
        return cut_at_stop(text, self.stop)

    def script(self, text: str) -> str:
        """What runs: head + block + tail."""
        return join_script(self.head, self.block(text), self.tail)

    def completion(self, text: str) -> str:
        """The completion sent to the grader (its extraction rule finds the one fenced block)."""
        return f"{OPEN_FENCE}{self.script(text).rstrip()}\n{CLOSE_FENCE}\n"

    def to_dict(self) -> dict[str, Any]:
        return {"head": self.head, "tail": self.tail, "hint": self.hint, "stop": list(self.stop)}


def scaffold_of(task: Mapping[str, Any] | None) -> Scaffold | None:
    """The scaffold in a case's task details, None when it has none; malformed ones raise."""
    raw = (task or {}).get("scaffold")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ScaffoldError(f"task {(task or {}).get('id')!r}: scaffold must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"head", "tail", "hint", "stop"})
    if unknown:
        raise ScaffoldError(f"task {task.get('id')!r}: scaffold has unknown keys {unknown}")
    for key in ("head", "tail"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ScaffoldError(f"task {task.get('id')!r}: scaffold.{key} must be a non-empty string")
    if CLOSE_FENCE in raw["head"] or CLOSE_FENCE in raw["tail"]:
        raise ScaffoldError(f"task {task.get('id')!r}: scaffold head/tail must not contain ```")
    stop = raw.get("stop", list(DEFAULT_STOP))
    if not isinstance(stop, Sequence) or isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ScaffoldError(f"task {task.get('id')!r}: scaffold.stop must be a list of non-empty strings")
    stops = tuple(dict.fromkeys([*stop, *DEFAULT_STOP]))  # a closing fence always ends the block
    return Scaffold(head=raw["head"], tail=raw["tail"], hint=str(raw.get("hint", "")), stop=stops)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string. Engines stop
    on the token that completes a stop string, so the sampled text may run past it."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def join_script(head: str, block: str, tail: str) -> str:
    """head + block + tail with each part on its own lines (no part glued to the next)."""
    out = head
    if block:
        out += block if block.endswith("\n") else block + "\n"
    elif out and not out.endswith("\n"):
        out += "\n"
    return out + tail
