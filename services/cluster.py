"""What the Ray cluster holds, as services/placement.py's plain records: its nodes (labels,
resources, alive or not) and where the run's parts run (rollout and grader Serve replicas from
the GCS actor table, learner workers from their coordinator). Thin Ray wiring only; the
decisions over these records are services/placement.py's."""

from __future__ import annotations

from typing import Any

from services.placement import Held, Node, needs_of, placement_problems


def nodes() -> list[Node]:
    """Every node the GCS knows, dead ones included (a node-loss message names them)."""
    import ray

    return [Node(node_id=n["NodeID"], alive=bool(n.get("Alive")), labels=dict(n.get("Labels") or {}),
                 resources=dict(n.get("Resources") or {})) for n in ray.nodes()]


def check_placement(cfg: Any) -> None:
    """Refuse, before anything starts, a run whose rollout, learner or grader section asks for a
    node no live node is (Ray would keep that replica or worker pending forever)."""
    problems = placement_problems(nodes(), needs_of(cfg))
    if problems:
        raise RuntimeError("; ".join(problems) + ". Start nodes with those resources/labels "
                           "(`ray start --resources ... --labels ...`) or relax the sections' placement fields.")


def serve_replicas(app: str, part: str) -> list[Held]:
    """The live Serve replicas of ``app``, read from the GCS actor table (no dashboard needed:
    the local cluster runs without one). Serve names a replica actor's class
    ``ServeReplica:<app>:<deployment>``."""
    from ray._private.state import actors  # the GCS table behind `ray list actors`; no State API

    prefix = f"ServeReplica:{app}:"
    out = []
    for info in actors(actor_state_name="ALIVE").values():
        if str(info.get("ActorClassName", "")).startswith(prefix):
            out.append(Held(part, f"replica {info['ActorID'][:12]}", info["Address"]["NodeID"], info.get("Pid") or None))
    return sorted(out, key=lambda h: h.what)


def where(cfg: Any, learner: Any | None) -> list[Held]:
    """Where each part of the run runs now: rollout replicas, grader replicas (when the run
    started its grader), learner ranks."""
    from rollout.deployment import APP_NAME

    held = serve_replicas(APP_NAME, "rollout")
    if cfg.grader.address is None:
        held += serve_replicas(cfg.grader.app_name, "grader")
    if learner is not None:
        held += [Held("learner", f"rank {w['rank']}", w["node_id"], w.get("pid")) for w in learner.workers()]
    return held


def placement_record(cfg: Any, learner: Any | None) -> dict[str, Any]:
    """run.json's ``placement``: each part's actors with their node, and each node's own labels."""
    held = where(cfg, learner)
    by_id = {n.node_id: n for n in nodes()}
    used = sorted({h.node_id for h in held})
    return {
        "parts": [{"part": h.part, "what": h.what, "node_id": h.node_id, "pid": h.pid} for h in held],
        "nodes": {nid: {k: v for k, v in sorted(by_id[nid].labels.items()) if not k.startswith("ray.io/")}
                  for nid in used if nid in by_id},
    }
