"""The shared-token check of the grader servers, as plain functions (no gRPC imports).

A deployment that sets `grader.token_env` or `grader.token_file` makes every server refuse
Grader RPCs whose `x-counterpoint-token` metadata is missing or differs (UNAUTHENTICATED);
`GraderClient.from_config` sends it. Health checks (`grpc.health.v1`) and reflection stay open.
The token is read where it is used (the server's or replica's process) and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

TOKEN_METADATA = "x-counterpoint-token"
UNAUTHENTICATED_DETAILS = f"missing or wrong {TOKEN_METADATA} metadata"


class TokenError(ValueError):
    """The configured token source holds no token."""


def resolve_token(token_env: str | None, token_file: str | None) -> str | None:
    """The shared token from an environment variable or a file; None when neither is set.

    Raises TokenError naming the source (never the value) when it is set but empty or absent.
    """
    if token_env is not None:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise TokenError(f"grader.token_env={token_env}: the variable is unset or empty")
        return token
    if token_file is not None:
        try:
            token = Path(token_file).read_text("utf-8").strip()
        except OSError as exc:
            raise TokenError(f"grader.token_file={token_file}: {exc.strerror or exc}") from None
        if not token:
            raise TokenError(f"grader.token_file={token_file}: the file is empty")
        return token
    return None


def token_ok(expected: str | None, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether call metadata carries the expected token (always True when none is expected)."""
    if expected is None:
        return True
    for key, value in metadata or ():
        if key == TOKEN_METADATA:
            given = value.encode() if isinstance(value, str) else value
            if hmac.compare_digest(given, expected.encode()):
                return True
    return False
