"""JSON Lines as a run writes them: durable appends, whole-file atomic writes, and a reader that
tells a torn last line (a crash mid-write: not an error) from corruption (an error naming the
file and line). A record is committed once its trailing newline is on disk."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class RecordError(ValueError):
    """A record that breaks its schema, or a run's file that is corrupt beyond a torn last line."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole: readers see the old file or the new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def jsonl_text(records: Iterable[Mapping[str, Any]]) -> str:
    """Records as JSON Lines, one compact object per line."""
    return "".join(json.dumps(dict(r), separators=(",", ":")) + "\n" for r in records)


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
    """Committed records of ``path`` (a torn last line is ignored, not an error; no file: none).
    A bad line anywhere else is corruption and raises RecordError, naming the file and line."""
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
            raise RecordError(f"{path}:{number}: not a JSON line ({err.msg})") from None
    return records
