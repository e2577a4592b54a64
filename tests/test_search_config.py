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
    (["trainer.eval_heldout=true"], "trainer.eval_heldout"),
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
