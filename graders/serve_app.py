"""The grader as a Ray Serve application: gRPC ingress + autoscaling replicas.

Each replica holds a `GraderCore` (pool + verifier) and answers the `Grader` RPCs through
Serve's gRPC proxy (`gRPCOptions(grpc_servicer_functions=[GRPC_SERVICER_FN])`). Callers pass
the metadata `application: <app name>` (`GraderClient(..., application=...)`).

What Serve's gRPC proxy (Ray 2.60) serves: the `Grader` methods, its own
`ray.serve.RayServeAPIService` (`Healthz`, `ListApplications`) and server reflection
(`gRPCOptions.enable_reflection`, default on). It does NOT serve `grpc.health.v1.Health`
(probe `RayServeAPIService/Healthz` or call `Grader/Health`), and it binds `[::]:<port>`
(all interfaces; Ray 2.60 has no host option for gRPC): keep the port firewalled.

Per-replica state: `Health` counters are those of the replica that answered. The
`counterpoint_grader_*` series are recorded through `ray.util.metrics` and exported by Ray's
metrics agent on each node (`ray.init(_metrics_export_port=...)`; the trainer records the
endpoint in its receipt); the plain server exposes them on its own `--metrics-port`.

The orchestrator may skip gRPC altogether: a `DeploymentHandle` to this app exposes
`score_batch(pairs)`, `cases(limit, split)` and `health()` returning the same typed values as
`graders.client.GraderClient`.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from graders.config import GraderConfig

GRPC_SERVICER_FN = "graders.proto.grader_pb2_grpc.add_GraderServicer_to_server"
DEPLOYMENT_NAME = "Grader"


@serve.deployment(name=DEPLOYMENT_NAME)
class GraderDeployment:
    def __init__(self, config: dict) -> None:
        from graders.fixtures import load_pool
        from graders.metrics import use_ray_metrics
        from graders.service import GraderCore
        from services.runtime_env import apply_defaults

        apply_defaults()
        use_ray_metrics()  # exported by Ray's metrics agent of this node
        cfg = GraderConfig(**config)
        pool = load_pool(cfg.fixture, cfg.heldout_fixture, cfg.voices, cfg.style, cfg.bars)
        self.core = GraderCore(pool, cfg.voices, cfg.style, cfg.checker, cfg.task)

    def _grpc(self, rpc: str, request, grpc_context):
        from graders.service import status_of

        try:
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

    # Handle path (Python callers inside the cluster).
    def score_batch(self, pairs: list[tuple[str, str]]):
        from graders.client import _score

        return [_score(r) for r in self.core.score_pairs([tuple(p) for p in pairs])]

    def cases(self, limit: int = 0, split: str = "train"):
        from graders.client import _case
        from graders.proto import grader_pb2 as pb

        reply = self.core.cases(pb.CasesRequest(limit=limit, split=split))
        return [_case(c) for c in reply.cases]

    def health(self):
        from graders.client import _health

        return _health(self.core.health())


def deployment_options(cfg: GraderConfig) -> dict[str, Any]:
    """Replica count, autoscaling bounds and CPUs from the grader config."""
    low = cfg.min_replicas or cfg.replicas
    high = max(cfg.max_replicas or cfg.replicas, low)
    initial = min(max(cfg.replicas, low), high)
    return {
        "autoscaling_config": {
            "min_replicas": low,
            "initial_replicas": initial,
            "max_replicas": high,
            "target_ongoing_requests": cfg.target_ongoing_requests,
        },
        "max_ongoing_requests": max(16, int(2 * cfg.target_ongoing_requests)),
        "ray_actor_options": {"num_cpus": cfg.num_cpus},
    }


def build_app(cfg: GraderConfig):
    """The bound Serve application for a grader config."""
    fields = cfg.model_dump(
        include={"task", "fixture", "heldout_fixture", "voices", "style", "checker", "bars"}
    )
    return GraderDeployment.options(**deployment_options(cfg)).bind(fields)


def app_builder(args: dict[str, Any]):
    """`serve run` / `serve deploy` entry (deploy/serve/grader.yaml): args are GraderConfig
    fields; replica settings in the YAML's `deployments:` section override these."""
    return build_app(GraderConfig(**(args or {})))


def start(
    cfg: GraderConfig,
    grpc_port: int,
    http_port: int = 8000,
    app_name: str | None = None,
):
    """Start Serve (HTTP proxy on 127.0.0.1:http_port, gRPC ingress on grpc_port) and deploy the
    grader app; returns its DeploymentHandle once every replica is ready. Ray must be up."""
    from ray.serve.config import gRPCOptions

    app_name = app_name or cfg.app_name
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FN]),
    )
    # An ingress needs a route prefix, also for gRPC (None = no proxy endpoint at all).
    return serve.run(build_app(cfg), name=app_name, route_prefix=f"/{app_name}")
