"""Which (mode, parent) the next expansion grows: AIDE's search policy as a pure, seeded function.

AIDE (Jiang et al. 2025, `aide/agent.py: search_policy`), per expansion:
1. while the tree holds fewer than `num_drafts` draft nodes: draft;
2. with probability `debug_prob`: debug a buggy leaf whose debug depth <= `max_debug_depth`
   (chosen uniformly), when there is one;
3. otherwise improve the best valid node on the selection metric (validation by default);
   draft while no node is valid.

Counterpoint's one change: an expansion samples N/E siblings from the one (mode, parent) it
picks, so the siblings share a prompt and form one GRPO group (AIDE grows one node per step).
The random draw comes from a stream keyed on (run seed, search.seed, step, expansion index in
the tree). AIDE draws every coin from one continuing stream; keyed on the expansion index alone,
a fresh tree per round (search.carry_tree=false) would restart at expansion 0 and draw the same
coins every round, so "debug with probability 0.5" would become always or never for a run. With
the step in the key each round draws new coins, while the same (run seed, step) and tree still
give the same choice, in a fresh process or after a resume.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from config.search import SearchConfig
from search.tree import Tree


@dataclass(frozen=True)
class Choice:
    mode: str  # draft | improve | debug
    parent_id: str | None
    reason: str  # which rule fired: initial_drafts | debug | improve_best | no_valid_node


def rng_for(cfg: SearchConfig, run_seed: int, step: int, expansion: int) -> random.Random:
    # str seeds are hashed with sha512 (not PYTHONHASHSEED): stable across processes.
    return random.Random(f"{run_seed}:{cfg.seed}:{step}:{expansion}")


def choose_expansion(tree: Tree, cfg: SearchConfig, *, run_seed: int, step: int,
                     expansion: int | None = None) -> Choice:
    """The (mode, parent) of expansion number `expansion` (default: the tree's next one) of
    training step `step` in a run seeded `run_seed` (RunConfig.seed)."""
    rng = rng_for(cfg, run_seed, step, tree.expansions if expansion is None else expansion)
    if len(tree.draft_nodes()) < cfg.num_drafts:
        return Choice("draft", None, "initial_drafts")
    # Draw whether or not a debuggable node exists, so the stream does not depend on it.
    if rng.random() < cfg.debug_prob:
        candidates = tree.debuggable(cfg.max_debug_depth, cfg.debug_leaves_only)
        if candidates:
            return Choice("debug", rng.choice(candidates).id, "debug")
    best = tree.best_valid(cfg.select_on)
    if best is None:
        return Choice("draft", None, "no_valid_node")
    return Choice("improve", best.id, "improve_best")
