"""A small typed client for the Grader service (plain server or Serve's gRPC ingress).

Every RPC is idempotent (scoring is a pure function of the request; only the Health counters
move), so every failure that may be the server's rather than the request's is retried with
exponential backoff (`GraderConfig.max_retries`, `retry_backoff_s`): UNAVAILABLE,
DEADLINE_EXCEEDED, and INTERNAL, UNKNOWN and ABORTED — what Serve's gRPC proxy answers when the
replica holding the call dies ("actor died unexpectedly"). When retries run out a
`GraderUnavailable` is raised — a training step must never silently run on missing rewards.
Request errors (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED,
RESOURCE_EXHAUSTED for an oversized request, ...) are raised at once as `GraderRequestError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc

from config.grader import GraderConfig
from graders import wire
from graders.proto import grader_pb2 as pb
from graders.proto import grader_pb2_grpc as pb_grpc
from graders.types import CaseInfo, Health, Score  # noqa: F401  (what the client returns)

_GRADER = GraderConfig()  # the schema's defaults: declared there, read here

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
})


def retryable(code: grpc.StatusCode) -> bool:
    """Whether a call that failed with ``code`` may succeed when sent again unchanged."""
    return code in RETRYABLE


class GraderError(RuntimeError):
    """Base of client errors; ``code`` is the last gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class GraderUnavailable(GraderError):
    """The grader could not be reached within the retry budget."""


class GraderRequestError(GraderError):
    """The grader refused the request (bad argument, unknown case, pool too small)."""


class GraderClient:
    """``GraderClient("127.0.0.1:50051")``; pass ``application=`` for a Serve ingress.

    ``timeout_s`` is the per-attempt deadline; attempts = 1 + max_retries, the n-th retry
    waiting ``retry_backoff_s * 2**(n-1)`` seconds. Left out, they are the grader section's
    defaults (config/grader.py); ``from_config`` takes a whole section.
    """

    def __init__(
        self,
        address: str,
        *,
        application: str | None = None,
        max_retries: int = _GRADER.max_retries,
        retry_backoff_s: float = _GRADER.retry_backoff_s,
        timeout_s: float = _GRADER.timeout_s,
        token: str | None = None,
    ) -> None:
        if max_retries < 0 or retry_backoff_s <= 0:
            raise ValueError("max_retries must be >= 0 and retry_backoff_s > 0")
        from graders.auth import TOKEN_METADATA

        self.address = address
        self.metadata = ((("application", application),) if application else ()) + (
            ((TOKEN_METADATA, token),) if token else ()
        )
        self.retries = 0  # retried attempts over this client's life (failures it absorbed)
        # Every retryable failure, (time.monotonic(), rpc, "CODE: details"), so a caller can say
        # which of its calls a retry saved and how long that took (services/orchestrator.py).
        self.retry_events: list[tuple[float, str, str]] = []
        self._events_lock = threading.Lock()
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GraderStub(self._channel)

    @classmethod
    def from_config(
        cls, config, address: str | None = None, application: str | None = None
    ) -> GraderClient:
        """From a `GraderConfig` (address or host:port, retries, backoff, timeout, the shared
        token from token_env/token_file). Pass ``application=config.app_name`` when the address
        is Serve's gRPC proxy."""
        from graders.auth import resolve_token

        return cls(
            address or config.address or f"{config.host}:{config.port}",
            application=application,
            max_retries=config.max_retries,
            retry_backoff_s=config.retry_backoff_s,
            timeout_s=config.timeout_s,
            token=resolve_token(config.token_env, config.token_file),
        )

    def _call(self, rpc: str, request):
        method = getattr(self._stub, rpc)
        last: grpc.RpcError | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
                self.retries += 1
            try:
                return method(request, timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if not retryable(code):
                    raise GraderRequestError(
                        f"grader {self.address} {rpc}: {code.name}: {exc.details()}", code
                    ) from None
                last = exc
                with self._events_lock:  # score_spread sends chunks from several threads
                    self.retry_events.append((time.monotonic(), rpc, f"{code.name}: {(exc.details() or '')[:200]}"))
        assert last is not None
        raise GraderUnavailable(
            f"grader {self.address} {rpc} failed after {self.max_retries + 1} attempts: "
            f"{last.code().name}: {last.details()}",
            last.code(),
        )

    def health(self) -> Health:
        return wire.health_from_proto(self._call("Health", pb.HealthRequest()))

    def cases(self, limit: int = 0, split: str = "train") -> list[CaseInfo]:
        reply = self._call("Cases", pb.CasesRequest(limit=limit, split=split))
        return [wire.case_from_proto(c) for c in reply.cases]

    def score(self, case_id: str, completion: str) -> Score:
        return wire.score_from_proto(self._call("Score", pb.ScoreRequest(case_id=case_id, completion=completion)))

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[Score]:
        """Scores in the order of ``pairs``; raises rather than return fewer."""
        request = pb.ScoreBatchRequest(
            requests=[pb.ScoreRequest(case_id=c, completion=t) for c, t in pairs]
        )
        replies = self._call("ScoreBatch", request).replies
        if len(replies) != len(pairs):
            raise GraderError(f"grader returned {len(replies)} scores for {len(pairs)} requests")
        return [wire.score_from_proto(r) for r in replies]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GraderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
