"""The search section in the run config (config/search.py) and trainer.rollout_mode: flat by
default, tree only where it can run, each refusal naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TREE = ["trainer.rollout_mode=tree", "grader.task=code-exec", "trainer.prompts_per_step=1"]


def test_flat_by_default_and_the_search_section_is_composed():
    cfg = load_config(None)
    assert cfg.trainer.rollout_mode == "flat"
    assert (cfg.search.nodes_per_round, cfg.search.expansions_per_round, cfg.search.siblings) == (32, 4, 8)
    assert load_config(None, [*TREE, "search.nodes_per_round=8", "search.expansions_per_round=2"]).search.siblings == 4


@pytest.mark.parametrize("extra, names", [
    (["grader.task=voice-leading"], "grader.task"),
    (["trainer.mode=one_step_off"], "trainer.mode"),
    (["trainer.prompts_per_step=2"], "trainer.prompts_per_step"),
    (["eval.before_and_after=true", "trainer.prefix_mode=forced_opening"], "trainer.prefix_mode"),
    (["search.nodes_per_round=6", "search.expansions_per_round=4"], "search.nodes_per_round"),
    (["search.select_on=train"], "select_on"),
])
def test_tree_mode_refusals_name_the_key(extra, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(None, [*TREE, *extra])


@pytest.mark.parametrize("name", ["mle-tree.yaml", "mle-tree-qwen3-4b.yaml", "mle-tree-qwen3-32b.yaml"])
def test_shipped_tree_configs(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.trainer.rollout_mode == "tree" and cfg.grader.task == "code-exec"
    assert cfg.rollout.max_tokens < cfg.rollout.max_model_len


def test_task_ladder_is_read_where_the_driver_sees_it(tmp_path):
    """Tree diagnostics compare a round with the task's reference ladder (ladder.json beside the
    tasks), which the driver asks the code-exec task's profile for; a driver that cannot see one
    gets {} (no best_vs_<rung> values), never an error. A task without a ladder answers {}."""
    import json

    from graders.tasks import task_profile

    cfg = load_config(None, ["grader.task=code-exec", f"grader.code_exec.tasks_dir={tmp_path}"])
    ladder = task_profile(cfg.grader.task).ladder
    assert ladder(cfg.grader, "tabular-binary") == {}
    entry = {"gbm": {"status": "ok", "val_metric": 0.72, "test_metric": 0.8}}
    (tmp_path / "ladder.json").write_text(json.dumps({"tabular-binary": entry}))
    assert ladder(cfg.grader, "tabular-binary") == entry and ladder(cfg.grader, "docs-topic") == {}
    assert task_profile("voice-leading").ladder(cfg.grader, "tabular-binary") == {}


def test_the_bundled_ladder_is_looked_for_where_the_tasks_are_built(tmp_path, monkeypatch):
    """Without code_exec.tasks_dir the ladder is the one beside the bundled tasks' build in the
    cache (what `grader ladder` writes), found without building the tasks."""
    import json

    from graders.code_exec.task import bundled_tasks_dir
    from graders.tasks import task_profile

    monkeypatch.setenv("COUNTERPOINT_CACHE", str(tmp_path))
    cfg = load_config(None, ["grader.task=code-exec"])
    built = bundled_tasks_dir(cfg.grader.code_exec.seed)
    assert built.is_relative_to(tmp_path) and not built.exists()
    assert task_profile("code-exec").ladder(cfg.grader, "tabular-binary") == {}
    built.mkdir(parents=True)
    (built / "ladder.json").write_text(json.dumps({"tabular-binary": {"linear": {"test_metric": 0.7}}}))
    assert task_profile("code-exec").ladder(cfg.grader, "tabular-binary") == {"linear": {"test_metric": 0.7}}
