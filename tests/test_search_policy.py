"""search.policy: every branch of AIDE's search policy, with seeds; the config's checks."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from pydantic import ValidationError

from config.search import SearchConfig
from search.policy import Choice, choose_expansion
from records.exec_result import ExecResult
from search.tree import Node, Tree


def mk(id, mode="draft", parent=None, status="ok", val=None, test=None, depth=0):
    return Node(id=id, parent_id=parent, mode=mode, step=1, round=0, expansion=0, sibling_group=0, index=0,
                prompt_messages=[], assistant_prefix="", raw_completion="", prompt_token_ids=[1],
                response_token_ids=[], response_logprobs=[], adapter_version=0, finish_reason="stop",
                debug_depth=depth,
                result=ExecResult(task_id="t", status=status, reward=0.0, test_metric=test, val_metric=val,
                                  oriented=val, exec_time=0.0, term_tail="", exc_type=None, message=None,
                                  isolation="none", limits={}, code="x = 1\n"))


AT = {"run_seed": 0, "step": 1}  # one (run seed, step): the coins of one round


def cfg(**kw) -> SearchConfig:
    return SearchConfig(**{"num_drafts": 2, **kw})


def tree_with(*nodes) -> Tree:
    t = Tree("t", "roc_auc", "higher")
    for n in nodes:
        t.add(n)
    return t


def test_defaults_are_aides():
    c = SearchConfig()
    assert (c.nodes_per_round, c.expansions_per_round, c.siblings) == (32, 4, 8)
    assert (c.num_drafts, c.debug_prob, c.max_debug_depth, c.debug_leaves_only) == (5, 0.5, 3, True)
    assert (c.select_on, c.carry_tree) == ("val", False)
    assert all(f.description for f in SearchConfig.model_fields.values())


@pytest.mark.parametrize("kw, msg", [
    ({"nodes_per_round": 10, "expansions_per_round": 4}, "multiple of search.expansions_per_round"),
    ({"debug_prob": 1.5}, "less than or equal to 1"),
    ({"select_on": "train"}, "'val' or 'test'"),
    ({"num_draft": 3}, "Extra inputs are not permitted"),
])
def test_config_rejects_bad_values(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        SearchConfig(**kw)


def test_initial_drafts_until_num_drafts_draft_nodes():
    assert choose_expansion(tree_with(), cfg(), **AT) == Choice("draft", None, "initial_drafts")
    t = tree_with(mk("a", status="crashed"))
    assert choose_expansion(t, cfg(debug_prob=1.0), **AT).reason == "initial_drafts"  # debug waits
    t.add(mk("b", val=0.6))
    assert choose_expansion(t, cfg(debug_prob=0.0), **AT) == Choice("improve", "b", "improve_best")
    assert choose_expansion(t, cfg(num_drafts=0, debug_prob=1.0), **AT) == Choice("debug", "a", "debug")


def test_debug_picks_a_buggy_leaf_within_depth_seeded():
    t = tree_with(mk("a", val=0.5), mk("b", status="crashed"), mk("c", status="timeout"),
                  mk("d", status="no_code"), mk("e", "debug", "d", status="crashed", depth=1))
    picks = Counter(choose_expansion(t, cfg(debug_prob=1.0, seed=s), **AT).parent_id for s in range(60))
    assert set(picks) == {"b", "c", "e"}  # d has a child; every buggy leaf gets picked by some seed
    assert all(v >= 10 for v in picks.values()), picks
    c1 = choose_expansion(t, cfg(debug_prob=1.0, seed=3), **AT)
    assert c1 == choose_expansion(t.copy(), cfg(debug_prob=1.0, seed=3), **AT)  # same seed, same choice
    assert c1.mode == "debug" and c1.reason == "debug"


def test_debug_depth_limit_is_inclusive():
    chain = [mk("a", val=0.5), mk("b", status="crashed")]
    parent = "b"
    for depth in range(1, 4):
        chain.append(mk(f"b{depth}", "debug", parent, status="crashed", depth=depth))
        parent = f"b{depth}"
    t = tree_with(*chain)  # only leaf b3 is buggy-and-leaf, at depth 3
    assert choose_expansion(t, cfg(debug_prob=1.0, max_debug_depth=3), **AT) == Choice("debug", "b3", "debug")
    assert choose_expansion(t, cfg(debug_prob=1.0, max_debug_depth=2), **AT) == Choice("improve", "a", "improve_best")


def test_debug_of_inner_buggy_nodes_when_leaves_only_is_off():
    t = tree_with(mk("a", val=0.5), mk("b", status="crashed"), mk("b1", "debug", "b", val=0.4, depth=1))
    assert choose_expansion(t, cfg(debug_prob=1.0), **AT).mode == "improve"  # no buggy leaf
    assert choose_expansion(t, cfg(debug_prob=1.0, debug_leaves_only=False), **AT) == Choice("debug", "b", "debug")


def test_improve_best_on_validation_not_test():
    t = tree_with(mk("a", val=0.60, test=0.50), mk("b", val=0.55, test=0.90), mk("c", status="crashed"))
    assert choose_expansion(t, cfg(debug_prob=0.0), **AT) == Choice("improve", "a", "improve_best")
    assert choose_expansion(t, cfg(debug_prob=0.0, select_on="test"), **AT).parent_id == "b"


def test_draft_while_no_valid_node():
    t = tree_with(mk("a", status="crashed"), mk("b", status="no_code"))
    assert choose_expansion(t, cfg(debug_prob=0.0), **AT) == Choice("draft", None, "no_valid_node")
    # debug drawn but nothing qualifies (depth): back to drafting
    t2 = tree_with(mk("a", status="crashed", depth=4), mk("b", status="crashed", depth=4))
    assert choose_expansion(t2, cfg(debug_prob=1.0), **AT) == Choice("draft", None, "no_valid_node")


def test_debug_prob_half_splits_expansions_by_seed_and_index():
    t = tree_with(mk("a", val=0.5), mk("b", status="crashed"))
    modes = Counter(choose_expansion(t, cfg(seed=s), **AT, expansion=e).mode for s in range(20) for e in range(20))
    assert set(modes) == {"debug", "improve"}
    assert 160 <= modes["debug"] <= 240, modes  # 400 seeded draws at p = 0.5
    # the tree's own counter is the default expansion index
    t.expansions = 7
    assert choose_expansion(t, cfg(seed=1), **AT) == choose_expansion(t, cfg(seed=1), **AT, expansion=7)
    assert {choose_expansion(t, cfg(seed=1), **AT, expansion=e).mode for e in range(10)} == {"debug", "improve"}


def _fresh_round_tree() -> Tree:
    """What every round's tree looks like after its drafts when search.carry_tree is false:
    a valid node to improve and a buggy leaf to debug."""
    return tree_with(mk("a", val=0.5), mk("b", status="crashed"))


@pytest.mark.parametrize("run_seed", [0, 1, 2, 7])
@pytest.mark.parametrize("debug_prob", [0.5, 0.2])
def test_debug_share_over_rounds_of_fresh_trees_is_debug_prob(run_seed, debug_prob):
    """Default shape (E = 4: expansion 0 drafts, 1..3 toss the coin), a fresh tree every round
    (carry_tree false), 150 rounds = 450 coins: the debug share is debug_prob within 4 binomial
    standard deviations, for several run seeds. Keyed on the expansion alone, every round drew
    the same 3 coins (seed 0: debug 120/120 rounds; seed 2: 0/120)."""
    c = cfg(debug_prob=debug_prob)
    draws = [choose_expansion(_fresh_round_tree(), c, run_seed=run_seed, step=step, expansion=e).mode
             for step in range(1, 151) for e in (1, 2, 3)]
    n = len(draws)
    share = draws.count("debug") / n
    assert abs(share - debug_prob) <= 4 * math.sqrt(debug_prob * (1 - debug_prob) / n), (share, n)
    # rounds differ from each other: not the same three coins every round
    per_round = {tuple(draws[i:i + 3]) for i in range(0, n, 3)}
    assert len(per_round) == 2 ** 3, per_round


def test_a_fixed_run_seed_and_step_reproduce_their_choices():
    c = cfg()
    picks = [choose_expansion(_fresh_round_tree(), c, run_seed=5, step=s, expansion=1) for s in range(1, 41)]
    assert picks == [choose_expansion(_fresh_round_tree(), c, run_seed=5, step=s, expansion=1) for s in range(1, 41)]
    other_seed = [choose_expansion(_fresh_round_tree(), c, run_seed=6, step=s, expansion=1) for s in range(1, 41)]
    other_search_seed = [choose_expansion(_fresh_round_tree(), cfg(seed=1), run_seed=5, step=s, expansion=1)
                         for s in range(1, 41)]
    assert picks != other_seed and picks != other_search_seed
