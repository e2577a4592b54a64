"""Bookkeeping of the adapter registry: published versions and what each replica holds.

Pure state (no Ray import): the Ray actor in `rollout.deployment` is a thin async shell around
`RegistryState`, so the rules below are unit-tested directly.

- Versions only move forward: publishing v <= latest is an error (a replica holding "v" would
  never reload, so a second, different v would be served silently).
- The last `keep` payloads stay reachable, so a request that names the previous version while
  the next one is being published can still be served.
- Replicas report (heartbeat) their held version and cumulative token count; a replica not
  heard from for `liveness_s` is taken for dead (Serve replaces it; the new one registers).
- `quiet`: replicas that make no progress, silent or stuck in one generate call past the stall
  deadline (config/liveness.py); the driver kills them (a frozen process is alive to Serve, whose
  health check takes minutes) and Serve starts their successors.

`keep` and `liveness_s` default to the rollout section's `adapters_kept` and
`replica_liveness_s` (config/rollout.py, where they are declared).
- `all_hold(v, expected)`: at least `expected` live replicas, every one of them holding v.
- A kept version's payload may be re-exported (`reexport`): same version, same checksum
  (model/adapter.py `blob_checksum`), a new ref. That is how a learner restored in the run
  makes the live version fetchable again once the process that owned its object has died; a
  payload with other bytes under the same version is refused, so a version names one adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from config.rollout import RolloutConfig

_ROLLOUT = RolloutConfig()  # the schema's defaults: declared there, read here


class AdapterUnavailableError(LookupError):
    """A request named an adapter version the registry cannot provide."""


@dataclass
class ReplicaInfo:
    replica_id: str
    actor_name: str
    version: int
    tokens: int
    last_seen: float
    node_id: str = ""  # the Ray node it runs on (placement records, node-loss messages)
    busy_since: float | None = None  # when its engine began the generate call it is in (None: idle)
    slowest_call_s: float = 0.0  # its slowest generate call so far (the stall deadline scales with it)


class RegistryState:
    def __init__(self, keep: int = _ROLLOUT.adapters_kept, liveness_s: float = _ROLLOUT.replica_liveness_s):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep = keep
        self.liveness_s = liveness_s
        self.latest = 0
        self._payloads: dict[int, tuple[Any, int | None]] = {}  # version -> (ref, checksum)
        self._replicas: dict[str, ReplicaInfo] = {}
        # Replicas taken for dead because they went silent, until the driver has replaced them
        # (``replaced``) or they speak again: a frozen process is alive to Ray and to Serve.
        self._silent: dict[str, ReplicaInfo] = {}
        self._tokens_of_gone = 0  # tokens of replicas forgotten, so the total never decreases

    # ----------------------------------------------------------------- versions

    def publish(self, version: int, payload_ref: Any, checksum: int | None = None) -> None:
        if version <= self.latest:
            raise ValueError(
                f"adapter version {version} is not newer than the latest published v{self.latest}"
            )
        self._payloads[version] = (payload_ref, checksum)
        self.latest = version
        for old in sorted(self._payloads)[: -self.keep]:
            del self._payloads[old]

    def reexport(self, version: int, payload_ref: Any, checksum: int | None) -> str | None:
        """Serve a kept version from a new ref; None when done, else why not (nothing changes)."""
        if version not in self._payloads:
            return f"adapter v{version} is not kept (registry keeps {sorted(self._payloads)})"
        published = self._payloads[version][1]
        if checksum is None or published is None:
            return f"adapter v{version}: no checksum to compare (published {published}, re-exported {checksum})"
        if checksum != published:
            return (f"adapter v{version} re-exported with other bytes (checksum {checksum}, published "
                    f"{published}): the replay did not reproduce it")
        self._payloads[version] = (payload_ref, checksum)
        return None

    def get(self, version: int) -> Any:
        if version in self._payloads:
            return self._payloads[version][0]
        if version > self.latest:
            raise AdapterUnavailableError(
                f"adapter v{version} has not been published (latest is v{self.latest})"
            )
        raise AdapterUnavailableError(
            f"adapter v{version} is no longer kept (registry keeps {sorted(self._payloads)})"
        )

    def versions(self) -> list[int]:
        return sorted(self._payloads)

    # ----------------------------------------------------------------- replicas

    def heartbeat(self, replica_id: str, actor_name: str, version: int, tokens: int, now: float,
                  node_id: str = "", busy_s: float = 0.0, slowest_call_s: float = 0.0) -> None:
        """A replica's report: ``busy_s`` how long its engine has been in its current generate
        call (0: idle), ``slowest_call_s`` its slowest finished call (both on its own clock)."""
        self._silent.pop(replica_id, None)
        self._replicas[replica_id] = ReplicaInfo(replica_id, actor_name, version, tokens, now, node_id,
                                                 now - busy_s if busy_s > 0 else None, slowest_call_s)

    def forget(self, replica_id: str) -> None:
        info = self._replicas.pop(replica_id, None)
        if info is not None:
            self._tokens_of_gone += info.tokens

    def live(self, now: float) -> list[ReplicaInfo]:
        for rid in [r for r, info in self._replicas.items() if now - info.last_seen > self.liveness_s]:
            self._silent[rid] = self._replicas[rid]
            self.forget(rid)
        return sorted(self._replicas.values(), key=lambda r: r.replica_id)

    def quiet(self, now: float, deadline_s: Callable[[float | None], float],
              notice: Callable[[float, float | None], bool]) -> list[dict]:
        """Replicas making no progress: silent ones (no report for ``liveness_s``: a frozen or
        wedged process) and ones whose engine has been in one generate call past
        ``deadline_s(slowest call)``, each with ``replace`` True; and, with ``replace`` False,
        busy ones past ``notice(busy_s, slowest call)`` that may still finish (config/liveness.py)."""
        self.live(now)
        out = [{"replica_id": r.replica_id, "actor_name": r.actor_name, "node_id": r.node_id, "replace": True,
                "quiet_s": now - r.last_seen,
                "why": f"no report for {now - r.last_seen:.0f} s (rollout.replica_liveness_s {self.liveness_s:g})"}
               for r in self._silent.values()]
        for r in self._replicas.values():
            if r.busy_since is None:
                continue
            busy, deadline = now - r.busy_since, deadline_s(r.slowest_call_s or None)
            if busy > deadline or notice(busy, r.slowest_call_s or None):
                out.append({"replica_id": r.replica_id, "actor_name": r.actor_name, "node_id": r.node_id,
                            "replace": busy > deadline, "quiet_s": busy, "slowest_s": r.slowest_call_s or None,
                            "why": f"one generate call running for {busy:.0f} s (stalled at {deadline:.0f} s: "
                                   f"its slowest call took {r.slowest_call_s:.1f} s)"})
        return sorted(out, key=lambda q: q["replica_id"])

    def replaced(self, replica_id: str) -> None:
        """The driver killed a quiet replica (Serve starts its successor): forget it."""
        self._silent.pop(replica_id, None)
        self.forget(replica_id)

    def all_hold(self, version: int, expected: int, now: float) -> bool:
        live = self.live(now)
        return len(live) >= expected and all(r.version == version for r in live)

    def tokens_total(self) -> int:
        return self._tokens_of_gone + sum(r.tokens for r in self._replicas.values())

    def snapshot(self, now: float) -> dict:
        """Plain data for metrics and status: live replicas' versions, cumulative tokens."""
        return {
            "latest": self.latest,
            "kept_versions": self.versions(),
            "replicas": {r.replica_id: r.version for r in self.live(now)},
            "actor_names": {r.replica_id: r.actor_name for r in self.live(now)},
            "tokens": {r.replica_id: r.tokens for r in self.live(now)},  # per live replica
            "nodes": {r.replica_id: r.node_id for r in self.live(now)},
            "tokens_total": self.tokens_total(),
        }


def went_on(noticed: dict[str, dict], replaced: set[str], worth: Callable[[float, float | None], bool]) -> list[dict]:
    """Of the replicas noticed busy in one generate call (replica id -> the last `quiet` entry
    seen for it), those that finished it by themselves after a stall worth recording
    (``worth(quiet_s, slowest_s)``: config/liveness.py worth_recording): outcome 'stalled'."""
    return [q for rid, q in sorted(noticed.items())
            if rid not in replaced and not q["replace"] and worth(q["quiet_s"], q.get("slowest_s"))]
