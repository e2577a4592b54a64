"""Per-process scratch directories (model/scratch.py): the name carries the pid, and the sweep
returns exactly the entries of processes that are gone."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from learner.worker import STAGE_PREFIX
from model.scratch import dead_scratch, make_scratch


def test_a_scratch_directory_is_named_by_its_process(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = make_scratch(STAGE_PREFIX, tag="r1-")
    assert made.parent == tmp_path and made.is_dir()
    assert made.name.startswith(f"{STAGE_PREFIX}{os.getpid()}-r1-")
    assert dead_scratch(tmp_path, STAGE_PREFIX) == []  # this process lives
    assert dead_scratch(tmp_path, STAGE_PREFIX, pid_alive=lambda pid: pid != os.getpid()) == [made]


def test_only_entries_of_dead_pids_are_found(tmp_path: Path):
    alive = {11, 12}
    names = [f"{STAGE_PREFIX}11-r0-a", f"{STAGE_PREFIX}13-r0-b", f"{STAGE_PREFIX}14-r1-c",
             f"{STAGE_PREFIX}12-r1-d", f"{STAGE_PREFIX}r0-legacy", f"{STAGE_PREFIX}x1-e", "other-13-f"]
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"{STAGE_PREFIX}15-file").write_text("x")  # a file of a dead process counts too
    found = dead_scratch(tmp_path, STAGE_PREFIX, pid_alive=alive.__contains__)
    assert [p.name for p in found] == [f"{STAGE_PREFIX}13-r0-b", f"{STAGE_PREFIX}14-r1-c", f"{STAGE_PREFIX}15-file"]
    for p in found:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    kept = set(names) - {f"{STAGE_PREFIX}13-r0-b", f"{STAGE_PREFIX}14-r1-c"}
    assert {p.name for p in tmp_path.iterdir()} == kept  # live pids, names without a pid, others' names
