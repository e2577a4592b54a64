"""The grader as a Ray Serve application: autoscaling replicas behind a gRPC ingress.

Each replica holds a `GraderCore` (pool + verifier). Two ways in over gRPC
(`GraderConfig.serve_ingress`):

- ``front`` (default; `counterpoint grader serve --ray`, a trainer's own grader): the plain
  grpcio server of `graders.service` runs in the starting process on `host:port` (127.0.0.1
  unless told otherwise; no SO_REUSEPORT; `max_message_bytes`; the shared token) and calls the
  replicas through a DeploymentHandle (`HandleCore`). Serve starts no proxy at all. A replica
  that dies under a call answers UNAVAILABLE, which clients retry.
- ``proxy`` (the cluster manifests: deploy/serve/grader.yaml, the KubeRay RayService): Serve's
  own gRPC proxy. Ray 2.60 binds it to ``[::]:<port>``, every interface, with no host option
  (`ray/serve/_private/grpc_util.py`, `start_grpc_server`): keep the port firewalled or
  require the token. Its message cap is Ray's `RAY_SERVE_GRPC_MAX_MESSAGE_SIZE` environment
  variable in the proxy's process (`start` passes it through the controller's runtime_env; a
  cluster sets it in the pods' environment); it caps replies as well. The proxy decodes
  requests with the deserializers of `GRPC_SERVICER_FN` (`add_grader_to_proxy`): they never
  raise, so an undecodable request reaches a replica and gets INVALID_ARGUMENT (the generated
  `add_GraderServicer_to_server` would make grpc.aio answer UNKNOWN from inside the proxy).
  Replicas check the token on every gRPC method. Callers pass the metadata
  `application: <app name>` (`GraderClient(..., application=...)`).

What Serve's gRPC proxy (Ray 2.60) serves: the `Grader` methods, its own
`ray.serve.RayServeAPIService` (`Healthz`, `ListApplications`) and server reflection. It does
NOT serve `grpc.health.v1.Health` (probe `RayServeAPIService/Healthz` or call `Grader/Health`);
the front serves grpc.health.v1 and reflection like the plain server.

Per-replica state: `Health` counters are those of the replica that answered (`replica` names
it). The `counterpoint_grader_*` series are recorded through `ray.util.metrics` and exported by
Ray's metrics agent on each node (`ray.init(_metrics_export_port=...)`; the trainer records the
endpoint in its receipt); the plain server exposes them on its own `--metrics-port`.

The orchestrator may skip gRPC altogether: a `DeploymentHandle` to this app exposes
`score_batch(pairs)`, `cases(limit, split)` and `health()` returning the same typed values as
`graders.client.GraderClient`.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from config.grader import GraderConfig
from config.liveness import LivenessConfig
from graders.ports import port_taken

GRPC_SERVICER_FN = "graders.serve_app.add_grader_to_proxy"
DEPLOYMENT_NAME = "Grader"
MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # read by Serve's proxy at import


def add_grader_to_proxy(servicer, server) -> None:
    """For `grpc_options.grpc_servicer_functions` of Serve's gRPC proxy: the Grader service
    with request deserializers that never raise (`graders.service.add_grader_servicer`)."""
    from graders.service import add_grader_servicer

    add_grader_servicer(servicer, server)


@serve.deployment(name=DEPLOYMENT_NAME)
class GraderDeployment:
    def __init__(self, config: dict, liveness: dict | None = None) -> None:
        from graders.auth import resolve_token
        from graders.metrics import use_ray_metrics
        from graders.service import GraderCore
        from graders.tasks import make_task
        from config.runtime_env import apply_defaults

        apply_defaults()
        use_ray_metrics()  # exported by Ray's metrics agent of this node
        cfg = GraderConfig(**config)
        replica = serve.get_replica_context().replica_id.unique_id
        self.core = GraderCore(make_task(cfg), replica)
        # when scoring that makes no progress counts as stalled (graders/progress.py): the run's
        # liveness section, and never sooner than the client's own timeout for a call
        self.liveness, self.call_timeout_s = LivenessConfig(**(liveness or {})), cfg.timeout_s
        self.token = resolve_token(cfg.token_env, cfg.token_file)  # checked on gRPC calls

    async def check_health(self) -> None:
        """Serve's health check, which the driver's pinger sends too (graders/autoscale.py): on
        the replica's event loop, which scoring does not hold. Raises GraderStalled once scoring
        has made no progress past its deadline: the pinger then kills the replica at once, and
        Serve's own check replaces it where no driver watches."""
        self.core.progress.check(self.liveness, self.call_timeout_s)

    def _grpc(self, rpc: str, request, grpc_context):
        from graders.auth import UNAUTHENTICATED_DETAILS, token_ok
        from graders.service import StatusError, check_decoded, status_of

        try:
            if not token_ok(self.token, grpc_context.invocation_metadata()):
                raise StatusError("UNAUTHENTICATED", UNAUTHENTICATED_DETAILS)
            check_decoded(request)
            return self.core.handle(rpc, request)
        except Exception as exc:
            # Serve keeps a status set on the context before the raise (gRPCStatusError).
            code, details = status_of(exc)
            grpc_context.set_code(code)
            grpc_context.set_details(details)
            raise

    # gRPC ingress: method names match the proto's RPCs.
    def Health(self, request, grpc_context):
        return self._grpc("Health", request, grpc_context)

    def Cases(self, request, grpc_context):
        return self._grpc("Cases", request, grpc_context)

    def Score(self, request, grpc_context):
        return self._grpc("Score", request, grpc_context)

    def ScoreBatch(self, request, grpc_context):
        return self._grpc("ScoreBatch", request, grpc_context)

    # The front's path: serialized request in, (status name, details, serialized reply) out.
    def call(self, rpc: str, request: bytes) -> tuple[str, str, bytes]:
        from graders.proto import grader_pb2 as pb
        from graders.service import status_of

        try:
            reply = self.core.handle(rpc, getattr(pb, f"{rpc}Request").FromString(request))
        except Exception as exc:
            code, details = status_of(exc)
            return code.name, details, b""
        return "", "", reply.SerializeToString()

    # Handle path (Python callers inside the cluster): the plain records, no proto round trip.
    def score_batch(self, pairs: list[tuple[str, str]]):
        return self.core.score_records([tuple(p) for p in pairs])

    def cases(self, limit: int = 0, split: str = "train"):
        return self.core.cases_records(limit, split)

    def health(self):
        return self.core.health_record()


def deployment_options(cfg: GraderConfig) -> dict[str, Any]:
    """Replica count, autoscaling bounds, CPUs, placement and the access log from the grader config."""
    low = cfg.min_replicas or cfg.replicas
    high = max(cfg.max_replicas or cfg.replicas, low)
    initial = min(max(cfg.replicas, low), high)
    return {
        "autoscaling_config": {
            "min_replicas": low,
            "initial_replicas": initial,
            "max_replicas": high,
            "target_ongoing_requests": cfg.target_ongoing_requests,
            "upscale_delay_s": cfg.upscale_delay_s,
            "downscale_delay_s": cfg.downscale_delay_s,
            "look_back_period_s": cfg.look_back_period_s,
            "metrics_interval_s": cfg.metrics_interval_s,
        },
        "max_ongoing_requests": max(16, int(2 * cfg.target_ongoing_requests)),
        "graceful_shutdown_wait_loop_s": cfg.shutdown_poll_s,
        "ray_actor_options": {"num_cpus": cfg.num_cpus, **(
            {"memory": cfg.replica_memory_mb * 2**20} if cfg.replica_memory_mb else {}),
            # where the replicas may run (grader.resources / grader.label_selector; none when unset)
            **({"resources": dict(cfg.resources)} if cfg.resources else {}),
            **({"label_selector": dict(cfg.label_selector)} if cfg.label_selector else {})},
        # Serve 2.60's per-deployment switch for its request log (serve.schema.LoggingConfig).
        "logging_config": {"enable_access_log": cfg.access_log},
    }


def front_workers(cfg: GraderConfig) -> int:
    """Threads of the front's grpcio server: as many calls as the app takes at its largest
    (max_replicas x max_ongoing_requests). Each call holds a thread while it waits on the
    replica, so fewer threads cap the in-flight requests Serve's autoscaler counts: with the
    former 8 and target_ongoing_requests 8, one replica never looked over target and the app
    could not scale up through the front."""
    options = deployment_options(cfg)
    return options["autoscaling_config"]["max_replicas"] * options["max_ongoing_requests"]


class HandleCore:
    """GraderCore's ``handle(rpc, request)`` over a DeploymentHandle, for the front server.

    Statuses the replica names come back as they are; a replica or the app that cannot take
    the call (a replica died under it, none is running yet) is UNAVAILABLE, so clients retry.
    """

    def __init__(self, handle, timeout_s: float) -> None:
        self._handle, self._timeout_s = handle, timeout_s

    def handle(self, rpc: str, request):
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import DeploymentUnavailableError

        from graders.proto import grader_pb2 as pb
        from graders.service import REPLY_TYPES, StatusError

        try:
            code, details, reply = self._handle.call.remote(
                rpc, request.SerializeToString()).result(timeout_s=self._timeout_s)
        except (RayActorError, DeploymentUnavailableError, TimeoutError) as exc:
            raise StatusError("UNAVAILABLE", f"grader replica unavailable: {exc}") from None
        except RayTaskError as exc:  # the replica raised outside `call`'s own handling
            raise StatusError("INTERNAL", str(exc).splitlines()[0]) from None
        if code:
            raise StatusError(code, details)
        return getattr(pb, REPLY_TYPES[rpc]).FromString(reply)


def build_app(cfg: GraderConfig | dict[str, Any], liveness: LivenessConfig | None = None):
    """The bound Serve application for a grader config (or a dict of its fields: `serve run`
    and RayService call this with their YAML `args`). ``liveness``: the run's section, which
    says when a replica's scoring is stalled (the schema's defaults where none is given)."""
    if not isinstance(cfg, GraderConfig):
        cfg = GraderConfig(**(cfg or {}))
    fields = cfg.model_dump(include={
        "task", "fixture", "heldout_fixture", "voices", "style", "checker", "bars",
        "token_env", "token_file", "code_exec", "timeout_s",
    })
    return GraderDeployment.options(**deployment_options(cfg)).bind(
        fields, (liveness or LivenessConfig()).model_dump())


def app_builder(args: dict[str, Any]):
    """`serve run` / `serve deploy` entry (deploy/serve/grader.yaml): args are GraderConfig
    fields; replica settings in the YAML's `deployments:` section override these."""
    return build_app(GraderConfig(**(args or {})))


def start(
    cfg: GraderConfig,
    grpc_port: int,
    http_port: int = 8000,
    app_name: str | None = None,
    liveness: LivenessConfig | None = None,
):
    """Deploy the grader app and its gRPC ingress (`cfg.serve_ingress`) on `grpc_port`; returns
    the app's DeploymentHandle once every replica is ready. Ray must be up.

    ``front``: Serve without proxies, and the plain grpcio server on cfg.host:grpc_port in
    this process (stopped by `stop_front`, or with the process). ``proxy``: Serve's HTTP proxy
    on 127.0.0.1:http_port and its gRPC proxy on [::]:grpc_port, capped at
    cfg.max_message_bytes, unless Serve is already running (then its proxies and their
    settings stay as they are). A front port that is taken raises `PortInUse` first.
    """
    from graders.auth import resolve_token
    from graders.service import PortInUse, start_server

    app_name = app_name or cfg.app_name
    token = resolve_token(cfg.token_env, cfg.token_file)  # fail here, not in every replica
    if cfg.serve_ingress == "front":
        if grpc_port and port_taken(cfg.host, grpc_port):
            raise PortInUse(f"{cfg.host}:{grpc_port} is in use (another grader?)")
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(cfg, liveness), name=app_name, route_prefix=None)
        stop_front(app_name)  # a front left from an earlier start of this app
        _FRONTS[app_name] = start_server(
            HandleCore(handle, cfg.timeout_s), cfg.host, grpc_port, max_workers=front_workers(cfg),
            max_message_bytes=cfg.max_message_bytes, token=token)
        return handle
    from ray.serve.config import gRPCOptions

    # No port check here: the proxy may already be up (Serve running, another app deployed).
    # `grader serve --ray --ingress proxy` checks [::]:port before it starts Ray.
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FN]),
        controller_options={  # the proxy inherits the controller's environment
            "runtime_env": {"env_vars": {MAX_MESSAGE_ENV: str(cfg.max_message_bytes)}}},
    )
    # An ingress needs a route prefix, also for gRPC (None = no proxy endpoint at all).
    return serve.run(build_app(cfg, liveness), name=app_name, route_prefix=f"/{app_name}")


_FRONTS: dict[str, Any] = {}


def front_address(app_name: str) -> str | None:
    """host:port of the front server started for an app in this process (None: none)."""
    front = _FRONTS.get(app_name)
    return front.address if front is not None else None


def front_port(app_name: str) -> int | None:
    """The port the front of an app started in this process bound (None: none); with
    grpc_port=0 it is the free port the bind itself found."""
    front = _FRONTS.get(app_name)
    return front.port if front is not None else None


def stop_front(app_name: str) -> None:
    front = _FRONTS.pop(app_name, None)
    if front is not None:
        front.stop(grace=1.0)
