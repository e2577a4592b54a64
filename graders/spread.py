"""Spread one batch over grader replicas: the caller splits it.

A ScoreBatch reaches one replica (the front's DeploymentHandle call or Serve's gRPC proxy
routes each request as a whole). To use every replica, the caller sends the batch as chunks,
concurrently, each its own ScoreBatch; Serve's router (power of two choices over in-flight
requests) sends concurrent chunks to different replicas. The driver does this for every task
(`grader.score_chunk`; a code-exec replica runs ``code_exec.max_concurrent`` scripts at a time,
so that is its chunk). The split is on the caller's side because it works the same through
either ingress (front or proxy) and over the plain server, and because each chunk keeps its own
retry: a replica dying under a chunk costs that chunk's resend, not the batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def sized_chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of at most ``size`` covering range(n) (a size;
    rollout/deployment.py even_chunks cuts into a number of chunks)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def score_spread(client, pairs: Sequence[tuple[str, str]], chunk: int, max_in_flight: int | None = None):
    """``client.score_batch`` over chunks of ``chunk`` pairs sent concurrently (at most
    ``max_in_flight`` at once; None = all); scores in the order of ``pairs``. ``client`` is a
    graders.client.GraderClient (its channel is thread-safe). The first failed chunk's error
    is raised."""
    bounds = sized_chunks(len(pairs), chunk)
    if not bounds:
        return []
    with ThreadPoolExecutor(max_workers=max_in_flight or len(bounds)) as pool:
        parts = list(pool.map(lambda b: client.score_batch(list(pairs[b[0]:b[1]])), bounds))
    return [s for part in parts for s in part]
