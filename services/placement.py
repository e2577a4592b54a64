"""Where the parts of a run may run and where they ran: pure functions over plain records of the
cluster's nodes and of the actors that hold the parts (services/cluster.py reads them from Ray).

- ``selector_matches`` / ``fitting_nodes``: which live nodes could hold a part, given the custom
  resources and node labels its config section names (config/placement.py) and its CPUs/GPUs.
- ``placement_problems``: before anything starts, the parts no live node can ever hold (Ray would
  wait for them forever), each as one line naming the section's fields.
- ``lost_parts`` / ``node_loss_message``: after a failure, which dead node held which part, as the
  one line a run that cannot go on stops with.

No Ray import: the records are dicts (``Node``) built elsewhere, so this is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS_PLACED = ("rollout", "learner", "grader")


@dataclass(frozen=True)
class Node:
    node_id: str
    alive: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)  # totals, not what is free now

    def short(self) -> str:
        """The node as a log line names it: its id's first 12 characters and its own labels."""
        own = {k: v for k, v in sorted(self.labels.items()) if not k.startswith("ray.io/")}
        return f"{self.node_id[:12]}" + (f" ({', '.join(f'{k}={v}' for k, v in own.items())})" if own else "")


@dataclass(frozen=True)
class Need:
    """What one replica or worker of a part needs from the node it lands on."""

    part: str
    resources: Mapping[str, float]  # CPU, GPU and custom resources of ONE replica/worker
    label_selector: Mapping[str, str]
    fields: str  # the config fields that set it, for messages


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Ray's label selector semantics for the forms config/placement.py accepts: `v` (equal),
    `!v` (absent or different), `in(a,b)`, `!in(a,b)`."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        body = want[1:] if negate else want
        if body.startswith("in(") and body.endswith(")"):
            options = {x.strip() for x in body[3:-1].split(",") if x.strip()}
            hit = have in options
        else:
            hit = have == body
        if hit == negate:
            return False
    return True


def fitting_nodes(nodes: Iterable[Node], need: Need) -> list[Node]:
    """Live nodes whose labels match and whose total resources hold one replica/worker."""
    return [n for n in nodes if n.alive and selector_matches(need.label_selector, n.labels)
            and all(n.resources.get(k, 0.0) + 1e-9 >= v for k, v in need.resources.items() if v > 0)]


def needs_of(cfg: Any) -> list[Need]:
    """One Need per part the run places on the cluster (a grader at grader.address is not ours)."""
    r, lc, g = cfg.rollout, cfg.learner, cfg.grader
    out = [Need("rollout", {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.resources}, dict(r.label_selector),
                "rollout.num_cpus/num_gpus/tensor_parallel_size/pipeline_parallel_size/resources/label_selector")]
    learner = {"CPU": lc.num_cpus_per_worker, **lc.resources_per_worker}
    if lc.use_gpu:
        learner["GPU"] = lc.gpus_per_worker
    out.append(Need("learner", learner, dict(lc.label_selector),
                    "learner.num_cpus_per_worker/gpus_per_worker/resources_per_worker/label_selector"))
    if g.address is None:
        out.append(Need("grader", {"CPU": g.num_cpus, **g.resources}, dict(g.label_selector),
                        "grader.num_cpus/resources/label_selector"))
    return out


def describe_need(need: Need) -> str:
    res = ", ".join(f"{k}={v:g}" for k, v in need.resources.items() if v > 0)
    sel = ", ".join(f"{k}={v}" for k, v in need.label_selector.items())
    return f"{{{res}}}" + (f" on nodes labelled {{{sel}}}" if sel else "")


def placement_problems(nodes: Sequence[Node], needs: Iterable[Need]) -> list[str]:
    """One line per part that no live node can hold."""
    return [f"no live node can hold a {n.part} {'worker' if n.part == 'learner' else 'replica'} "
            f"({describe_need(n)}; {n.fields})" for n in needs if not fitting_nodes(nodes, n)]


@dataclass(frozen=True)
class Held:
    """One actor of the run, as the placement record has it."""

    part: str  # rollout | learner | grader
    what: str  # "replica 3f2a..." / "rank 0"
    node_id: str
    pid: int | None = None


def lost_parts(held: Iterable[Held], nodes: Iterable[Node]) -> dict[str, list[Held]]:
    """node id -> what of ours it held, for every node that is no longer alive (or no longer known)."""
    alive = {n.node_id for n in nodes if n.alive}
    out: dict[str, list[Held]] = {}
    for h in held:
        if h.node_id and h.node_id not in alive:
            out.setdefault(h.node_id, []).append(h)
    return out


def node_loss_message(lost: Mapping[str, list[Held]], nodes: Iterable[Node], needs: Iterable[Need],
                      run_dir: str) -> str | None:
    """The one line a run that lost a node stops with: the node, what it held, what no live node
    can take over, and the command that continues the run. None when no dead node held a part
    that cannot be placed again (then the failure is not a node loss, or it heals by itself)."""
    if not lost:
        return None
    by_id = {n.node_id: n for n in nodes}
    needs = {n.part: n for n in needs}
    nowhere = []
    for held in lost.values():
        for part in sorted({h.part for h in held}):
            if part in needs and not fitting_nodes(by_id.values(), needs[part]):
                nowhere.append(part)
    if not nowhere:
        return None
    gone = "; ".join(
        f"node {by_id[nid].short() if nid in by_id else nid[:12]} is gone, it held "
        + ", ".join(f"{h.part} {h.what}" + (f" (pid {h.pid})" if h.pid else "") for h in held)
        for nid, held in sorted(lost.items()))
    cannot = "; ".join(f"no live node can hold the {p} ({describe_need(needs[p])})" for p in sorted(set(nowhere)))
    return f"{gone}; {cannot}: add such a node, then continue with: counterpoint train --resume {run_dir}"
