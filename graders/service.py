"""The grader over gRPC: a thin shell around one task (graders/tasks.py: a pool and a verifier,
plain Python) that knows nothing of any task.

`GraderCore` answers the four RPCs (proto in, proto out, through graders/wire.py) and raises
`PoolError` / `StatusError` (whose `code` names the status) for bad requests; the plain grpcio
servicer here and the Ray Serve deployment (`graders/serve_app.py`) only translate that into a
gRPC status. Anything unexpected becomes INTERNAL with its message: a grader never answers
UNKNOWN.

The server takes one port alone (no SO_REUSEPORT: a second server on a held port is refused,
`PortInUse`), caps request size (`GraderConfig.max_message_bytes`) and, given a token, refuses
Grader calls without it (`graders.auth`).
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from config.grader import GraderConfig
from graders import metrics, wire
from graders.auth import UNAUTHENTICATED_DETAILS, token_ok
from graders.proto import grader_pb2 as pb
from graders.proto import grader_pb2_grpc as pb_grpc
from graders.progress import ScoringProgress
from graders.types import CaseInfo, Health, PoolError, Score
from graders.tasks import Task

_GRADER = GraderConfig()  # the schema's defaults: declared there, read here

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Grader"].full_name  # counterpoint.grader.v1.Grader
RPCS = ("Health", "Cases", "Score", "ScoreBatch")


class StatusError(Exception):
    """A failure that names its gRPC status (``code``: a `grpc.StatusCode` name)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code = code

    def __reduce__(self):  # picklable: Serve ships a replica's exception to its proxy
        return type(self), (self.code, str(self))


class PortInUse(OSError):
    """Another server holds the port."""


class Undecodable:
    """Stands for a request its deserializer could not decode (see `add_grader_servicer`)."""

    def __init__(self, message: str, error: str) -> None:
        self.message, self.error = message, error


def check_decoded(request) -> None:
    """Raise StatusError(INVALID_ARGUMENT) for an `Undecodable` request."""
    if isinstance(request, Undecodable):
        raise StatusError(
            "INVALID_ARGUMENT", f"the request is not a {request.message}: {request.error}")


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as exc:  # DecodeError; nothing here may become UNKNOWN or INTERNAL
            return Undecodable(message_type.DESCRIPTOR.full_name, f"{type(exc).__name__}: {exc}")

    return parse


REPLY_TYPES = {"Health": "HealthReply", "Cases": "CasesReply", "Score": "ScoreReply",
               "ScoreBatch": "ScoreBatchReply"}


def add_grader_servicer(servicer, server) -> None:
    """`add_GraderServicer_to_server` with request deserializers that never raise.

    An undecodable request reaches the servicer as `Undecodable` and gets INVALID_ARGUMENT.
    grpcio's own path for a failed decode answers INTERNAL (grpc.aio, as in Serve's proxy:
    UNKNOWN) and leaks about 19 KiB per request in every grpcio from 1.62 to 1.85.3
    (bench/grpc_leak.py); this path leaks nothing.
    """
    handlers = {
        rpc: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, rpc),
            request_deserializer=_lenient(getattr(pb, f"{rpc}Request")),
            response_serializer=getattr(pb, reply).SerializeToString,
        )
        for rpc, reply in REPLY_TYPES.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:  # grpcio >= 1.63, as the generated 1.85 stubs do
        register(SERVICE_NAME, handlers)


def _config_default(name: str):
    return GraderConfig.model_fields[name].default


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("counterpoint")
    except Exception:  # not installed (a bare checkout on the path)
        return "unknown"


class GraderCore:
    """One task (graders/tasks.py) plus counters, answering the four RPCs: ``handle(rpc,
    request)`` takes and returns proto messages (graders/wire.py converts), the ``*_records``
    methods the plain records (the Serve handle path). Raises PoolError / StatusError for bad
    requests. Thread-safe as long as the task's score is (the counters lock)."""

    def __init__(self, task: Task, replica: str | None = None) -> None:
        self.task = task
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.counters = metrics.Counters()
        self.version = _version()
        self.progress = ScoringProgress()  # what the replica's health check judges (graders/progress.py)
        # a task whose cases take long reports each one (Task.score's on_case); others per batch
        self._on_case = "on_case" in inspect.signature(task.score).parameters

    def health_record(self) -> Health:
        info = self.task.info()
        return Health(
            task=self.task.name, pool_size=info.pool_size, pool_source=info.pool_source,
            counters=self.counters.snapshot(), heldout_pool_size=info.heldout_pool_size, version=self.version,
            replica=self.replica, voices=info.voices, style=info.style, checker=info.checker,
            openings_histogram=info.openings_histogram, details=info.details,
        )

    def cases_records(self, limit: int, split: str) -> list[CaseInfo]:
        if limit < 0:
            raise PoolError(f"limit must be >= 0, got {limit}")
        return self.task.cases(limit, split or "train")

    def score_records(self, pairs: list[tuple[str, str]]) -> list[Score]:
        """Score (case_id, completion) pairs in order; the task checks every id before scoring."""
        self.progress.begin()
        try:
            scores = self.task.score(pairs, on_case=self.progress.case_done) if self._on_case else self.task.score(pairs)
        finally:
            self.progress.end()
        if len(scores) != len(pairs):
            raise StatusError("INTERNAL", f"task {self.task.name} returned {len(scores)} scores for {len(pairs)}")
        for s in scores:
            self.counters.add(format_ok=s.format_ok, admitted=s.admitted, first_measure_ok=s.first_measure_ok)
        metrics.observe_scores(self.task.name, [s.verdict for s in scores])
        return scores

    def health(self, request: pb.HealthRequest | None = None) -> pb.HealthReply:
        return wire.health_to_proto(self.health_record())

    def cases(self, request: pb.CasesRequest) -> pb.CasesReply:
        split = request.split or "train"
        cases = self.cases_records(request.limit, split)
        return pb.CasesReply(cases=[wire.case_to_proto(c) for c in cases], pool_size=self.task_size(split))

    def task_size(self, split: str) -> int:
        info = self.task.info()
        return info.heldout_pool_size if split == "heldout" else info.pool_size

    def score(self, request: pb.ScoreRequest) -> pb.ScoreReply:
        return wire.score_to_proto(self.score_records([(request.case_id, request.completion)])[0])

    def score_batch(self, request: pb.ScoreBatchRequest) -> pb.ScoreBatchReply:
        pairs = [(r.case_id, r.completion) for r in request.requests]
        return pb.ScoreBatchReply(replies=[wire.score_to_proto(s) for s in self.score_records(pairs)])

    def handle(self, rpc: str, request):
        """Dispatch by RPC name, timing it (Prometheus latency histogram)."""
        method: Callable = {
            "Health": self.health,
            "Cases": self.cases,
            "Score": self.score,
            "ScoreBatch": self.score_batch,
        }[rpc]
        start = time.perf_counter()
        try:
            return method(request)
        finally:
            metrics.observe_latency(self.task.name, rpc, time.perf_counter() - start)


# Status details travel as the grpc-message header: past grpc's metadata limit (8 KiB soft,
# 16 KiB hard) the client receives RESOURCE_EXHAUSTED instead of the status we chose, so a
# message that echoes request input (a 20,000-character case_id) is cut to a size well inside it.
MAX_DETAILS_CHARS = 1024


def bounded_details(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``details`` cut to at most ``limit`` characters, saying how much was cut (pure)."""
    if len(details) <= limit:
        return details
    note = f" ... [{len(details) - limit} characters cut]"
    return details[: limit - len(note)] + note


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception raised by GraderCore (never UNKNOWN), with details
    bounded (bounded_details) whatever the request echoed into them."""
    if isinstance(exc, PoolError | StatusError):
        return getattr(grpc.StatusCode, exc.code), bounded_details(str(exc))
    return grpc.StatusCode.INTERNAL, bounded_details(f"{type(exc).__name__}: {exc}")


class GraderServicer(pb_grpc.GraderServicer):
    """grpcio servicer: GraderCore plus status mapping."""

    def __init__(self, core: GraderCore) -> None:
        self.core = core

    def _call(self, rpc: str, request, context: grpc.ServicerContext):
        try:
            check_decoded(request)
            return self.core.handle(rpc, request)
        except Exception as exc:
            code, details = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("grader %s failed", rpc)
            context.abort(code, details)

    def Health(self, request, context):
        return self._call("Health", request, context)

    def Cases(self, request, context):
        return self._call("Cases", request, context)

    def Score(self, request, context):
        return self._call("Score", request, context)

    def ScoreBatch(self, request, context):
        return self._call("ScoreBatch", request, context)


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuse Grader RPCs without the shared token; health and reflection stay open."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._refuse = grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(
                grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
        )

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(f"/{SERVICE_NAME}/") and not token_ok(
            self._token, handler_call_details.invocation_metadata
        ):
            return self._refuse
        return continuation(handler_call_details)


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """grpcio server options: one server per port, and the request size cap."""
    return [
        ("grpc.so_reuseport", 0),  # grpcio sets SO_REUSEPORT by default: two servers, one port
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass
class RunningServer:
    server: grpc.Server
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()


def start_server(
    core: GraderCore,
    host: str = _GRADER.host,
    port: int = 0,
    max_workers: int = 8,
    *,
    max_message_bytes: int | None = None,
    token: str | None = None,
) -> RunningServer:
    """Start a grpcio server with the Grader, grpc.health.v1 and reflection services.

    Binds host:port (port 0 = a free port) and returns once it is serving; a port another
    server holds raises `PortInUse`. ``max_message_bytes`` (None = the config default) caps
    requests; ``token`` (None = open) is required as `x-counterpoint-token` metadata on Grader
    calls. ``core`` is anything with GraderCore's ``handle(rpc, request)``. Health and
    reflection come from grpcio-health-checking / grpcio-reflection (project dependencies);
    an image without them (the lent GPU image has neither) still serves Grader, with a warning.
    """
    if max_message_bytes is None:
        max_message_bytes = _config_default("max_message_bytes")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[_TokenInterceptor(token)] if token is not None else None,
        options=server_options(max_message_bytes),
    )
    add_grader_servicer(GraderServicer(core), server)
    mark_serving = _add_standard_services(server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.60 raises where older releases returned 0
        bound = 0
    if not bound:
        raise PortInUse(f"{host}:{port} is in use (another grader?) or cannot be bound")
    server.start()
    mark_serving()
    return RunningServer(server, host, bound)


def _add_standard_services(server: grpc.Server) -> Callable[[], None]:
    """Register grpc.health.v1 and reflection; returns the call that marks them SERVING."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
    except ImportError as exc:
        log.warning("%s: serving without grpc.health.v1 and reflection", exc)
        return lambda: None
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )

    def mark_serving() -> None:
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    return mark_serving
