"""Files that cross between the driver and the learner workers as bytes, never through a shared
disk: the workers may run on nodes that cannot see the run directory (README "What survives
what").

A bundle is ``{relative posix path: bytes}``. Workers write what a command produces (adapters/,
checkpoints/) under a private staging directory laid out like the run directory, ``pack`` it,
and the driver ``write_bundle``s it into the real one; a checkpoint or init adapter going the
other way is ``pack``ed by the driver and ``unpack``ed by every worker. Pure file handling.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

Bundle = dict[str, bytes]


def pack(root: Path) -> Bundle:
    """Every regular file under ``root``, by its path relative to it."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _safe(rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"bundle path {rel!r} leaves its root")
    return path


def unpack(files: Mapping[str, bytes], root: Path) -> Path:
    """Write a bundle under ``root`` (created); returns ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        target = root / _safe(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


def units(files: Mapping[str, bytes]) -> dict[str, Bundle]:
    """The bundle cut into the directories a run records whole: the first two path parts
    (``checkpoints/step_4``, ``adapters/init``) -> {path inside it: bytes}."""
    out: dict[str, Bundle] = {}
    for rel, data in files.items():
        parts = _safe(rel).parts
        if len(parts) < 3:
            raise ValueError(f"bundle path {rel!r} is not inside a <kind>/<name>/ directory")
        out.setdefault("/".join(parts[:2]), {})["/".join(parts[2:])] = data
    return out


def write_bundle(files: Mapping[str, bytes], root: Path) -> list[Path]:
    """Write each unit of ``files`` into ``root`` atomically (a hidden partial directory, then one
    rename), so a driver killed mid-write leaves no half checkpoint under its real name. A unit
    already there with the same bytes is left as it is (a learner restored without a checkpoint
    writes adapters/init again); one with other bytes is refused: a run never overwrites a record.
    Returns the unit directories."""
    written = []
    for unit, inner in sorted(units(files).items()):
        dest = Path(root) / unit
        if dest.exists():
            if pack(dest) == inner:
                written.append(dest)
                continue
            raise FileExistsError(f"{dest} already holds other files; the learner would overwrite a record")
        partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
        if partial.exists():
            shutil.rmtree(partial)  # our own leftover of an earlier failed write, never a record
        unpack(inner, partial)
        os.rename(partial, dest)
        written.append(dest)
    return written
