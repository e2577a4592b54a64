"""Bundled code-exec tasks: seeded, byte-stable, MLE-bench layout, validated on load."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from graders.code_exec.build import build_tasks, ensure_built
from graders.code_exec.task import TaskError, load_task, load_tasks, resolve_tasks_dir


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tasks(tmp_path_factory.mktemp("a") / "tasks", seed=0)


def test_byte_stable_for_a_seed_and_different_across_seeds(built, tmp_path):
    again = build_tasks(tmp_path / "again", seed=0)
    assert _files(built) == _files(again)
    other = _files(build_tasks(tmp_path / "other", seed=1))
    assert other["tabular-binary/public/train.csv"] != _files(built)["tabular-binary/public/train.csv"]


def test_layout_kinds_and_splits(built):
    tasks = load_tasks(built)
    assert {t.id: t.metric for t in tasks.values()} == {
        "tabular-binary": "roc_auc", "docs-topic": "log_loss", "positive-regression": "rmsle"}
    assert len(tasks["docs-topic"].classes) >= 3
    assert tasks["positive-regression"].target_columns == ("y1", "y2")
    for t in tasks.values():
        assert sorted(os.listdir(t.public)) == ["description.md", "sample_submission.csv",
                                                "test.csv", "train.csv"]
        assert os.stat(t.dir / "private").st_mode & 0o077 == 0
        train, test = pd.read_csv(t.public / "train.csv"), pd.read_csv(t.public / "test.csv")
        ans, sample = pd.read_csv(t.answers_path), pd.read_csv(t.public / "sample_submission.csv")
        assert (len(train), (ans["split"] == "val").sum(), (ans["split"] == "test").sum()) == (
            t.rows["train"], t.rows["val"], t.rows["test"])
        assert 100 <= t.rows["val"] and t.rows["train"] + t.rows["val"] + t.rows["test"] <= 5000
        assert list(test["id"]) == list(ans["id"]) == list(sample["id"])
        assert set(train["id"]).isdisjoint(test["id"])
        assert not set(t.answer_columns) & set(test.columns)
        raw = json.loads((t.dir / "task.json").read_text())
        assert raw["split_seed"] == t.split_seed and raw["reward"] == t.reward
    text = pd.read_csv(tasks["docs-topic"].public / "train.csv")
    assert text["text"].str.len().mean() > 60
    pos = pd.read_csv(tasks["positive-regression"].answers_path)
    assert (pos[["y1", "y2"]] > 0).all().all()


def test_ensure_built_builds_once_atomically(tmp_path):
    target = tmp_path / "cache" / "tasks"
    assert ensure_built(target, 0) == target
    stamp = (target / "done").stat().st_mtime_ns
    ensure_built(target, 0)
    assert (target / "done").stat().st_mtime_ns == stamp
    assert [p.name for p in target.parent.iterdir()] == ["tasks"]  # no temp dirs left


def test_default_tasks_live_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTERPOINT_CACHE", str(tmp_path))
    d = resolve_tasks_dir(None, 3)
    assert d.parent == tmp_path / "code-exec" and d.name.endswith("seed3")
    assert len(load_tasks(d)) == 3
    with pytest.raises(TaskError, match="must be absolute"):
        resolve_tasks_dir("relative/tasks", 0)


def test_malformed_task_dirs_are_named(built, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(TaskError, match="missing task.json"):
        load_task(bad)
    (bad / "task.json").write_text(json.dumps({"id": "x", "metric": "accuracy", "id_column": "id",
                                               "target_columns": ["y"]}))
    with pytest.raises(TaskError, match="metric 'accuracy' is not one of"):
        load_task(bad)
    (bad / "task.json").write_text(json.dumps({"id": "x", "metric": "rmsle", "id_column": "id",
                                               "target_columns": ["y"], "reward": "1 - m"}))
    with pytest.raises(TaskError, match="reward '1 - m'"):
        load_task(bad)
    (bad / "public").mkdir()
    (bad / "public" / "answers.csv").write_text("id,y\n")
    (bad / "task.json").write_text(json.dumps({"id": "x", "metric": "rmsle", "id_column": "id",
                                               "target_columns": ["y"],
                                               "answers": "public/answers.csv"}))
    with pytest.raises(TaskError, match="inside public/"):
        load_task(bad)


def test_bundled_tasks_name_the_counterpoint_rules_they_describe(built):
    """The bundled tasks' task.json names `counterpoint` (the rules their descriptions state),
    whatever grader.code_exec.grading_rules says; the log-loss description states scikit-learn's
    clipping at the float64 eps, not 1e-15."""
    tasks = load_tasks(built)
    assert {t.grading_rules for t in tasks.values()} == {"counterpoint"}
    assert {t.rules("mle-bench") for t in tasks.values()} == {"counterpoint"}
    desc = (tasks["docs-topic"].public / "description.md").read_text()
    assert "within 1e-6" in desc and "eps = 2.2e-16" in desc and "1e-15" not in desc
