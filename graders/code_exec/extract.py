"""Code extraction from a model completion. Pure.

Rules (in order):
1. Reasoning inside `<think>...</think>` is dropped first (an unclosed `<think>` drops the rest).
2. Fenced blocks tagged python/py/python3 (```python ... ```) are the candidates; when there are
   none, untagged fences (``` ... ```) are. Blocks tagged with another language never count.
3. With several candidates the LAST one is the script: models show snippets first and the
   final program last, and concatenating them would duplicate code.
4. A final fence that never closes (a truncated generation) counts as a block running to the
   end of the text; it usually fails as a SyntaxError and is then graded `crashed`.
5. No candidate, or only whitespace inside it: no code (status `no_code`).
"""

from __future__ import annotations

import re

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n`]*\n(.*?)(?:(?<=\n)[ \t]*```|\Z)", re.S)
_PY = {"python", "py", "python3"}


def extract_code(completion: str) -> str | None:
    """The script to run, or None when the completion holds no usable code block."""
    text = _THINK.sub("", completion)
    tagged, untagged = [], []
    for m in _FENCE.finditer(text):
        lang = m.group(1).lower()
        if lang in _PY:
            tagged.append(m.group(2))
        elif lang == "":
            untagged.append(m.group(2))
    blocks = tagged or untagged
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1].rstrip() + "\n"
