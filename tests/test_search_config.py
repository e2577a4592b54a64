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


@pytest.mark.parametrize("name", ["mle-tree.yaml", "mle-tree-qwen3-4b.yaml"])
def test_shipped_tree_configs(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.trainer.rollout_mode == "tree" and cfg.grader.task == "code-exec"
    assert cfg.rollout.max_tokens < cfg.rollout.max_model_len


def test_task_ladder_is_read_where_the_driver_sees_it(tmp_path):
    """Tree diagnostics compare a round with the task's reference ladder (ladder.json beside the
    tasks); a driver that cannot see one gets {} (no best_vs_<rung> values), never an error."""
    import json

    from services.tree_round import task_ladder

    cfg = load_config(None, [f"grader.code_exec.tasks_dir={tmp_path}"])
    assert task_ladder(cfg, "tabular-binary") == {}
    entry = {"gbm": {"status": "ok", "val_metric": 0.72, "test_metric": 0.8}}
    (tmp_path / "ladder.json").write_text(json.dumps({"tabular-binary": entry}))
    assert task_ladder(cfg, "tabular-binary") == entry and task_ladder(cfg, "docs-topic") == {}
