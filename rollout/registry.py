"""Bookkeeping of the adapter registry: published versions and what each replica holds.

Pure state (no Ray import): the Ray actor in `rollout.deployment` is a thin async shell around
`RegistryState`, so the rules below are unit-tested directly.

- Versions only move forward: publishing v <= latest is an error (a replica holding "v" would
  never reload, so a second, different v would be served silently).
- The last `keep` payloads stay reachable, so a request that names the previous version while
  the next one is being published can still be served.
- Replicas report (heartbeat) their held version and cumulative token count; a replica not
  heard from for `liveness_s` is taken for dead (Serve replaces it; the new one registers).

`keep` and `liveness_s` default to the rollout section's `adapters_kept` and
`replica_liveness_s` (config/rollout.py, where they are declared).
- `all_hold(v, expected)`: at least `expected` live replicas, every one of them holding v.
- A kept version's payload may be re-exported (`reexport`): same version, same checksum
  (model/adapter.py `blob_checksum`), a new ref. That is how a learner restored in the run
  makes the live version fetchable again once the process that owned its object has died; a
  payload with other bytes under the same version is refused, so a version names one adapter.
"""

from __future__ import annotations

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


class RegistryState:
    def __init__(self, keep: int = _ROLLOUT.adapters_kept, liveness_s: float = _ROLLOUT.replica_liveness_s):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep = keep
        self.liveness_s = liveness_s
        self.latest = 0
        self._payloads: dict[int, tuple[Any, int | None]] = {}  # version -> (ref, checksum)
        self._replicas: dict[str, ReplicaInfo] = {}
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
                  node_id: str = "") -> None:
        self._replicas[replica_id] = ReplicaInfo(replica_id, actor_name, version, tokens, now, node_id)

    def forget(self, replica_id: str) -> None:
        info = self._replicas.pop(replica_id, None)
        if info is not None:
            self._tokens_of_gone += info.tokens

    def live(self, now: float) -> list[ReplicaInfo]:
        for rid in [r for r, info in self._replicas.items() if now - info.last_seen > self.liveness_s]:
            self.forget(rid)
        return sorted(self._replicas.values(), key=lambda r: r.replica_id)

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
