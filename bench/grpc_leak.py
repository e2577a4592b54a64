"""Does a bare grpcio server leak memory on requests it cannot decode?

A plain `grpc.server` on 127.0.0.1 with one unary method whose request deserializer is a
protobuf message's ``FromString`` (here ``google.protobuf.Duration``); a client in a
subprocess sends ``--n`` requests of bytes that are not that message (the server answers each
with INTERNAL "Exception deserializing request!"), then ``--n`` decodable ones as a control.
The server's RSS is read (``/proc/<pid>/status``, VmRSS) after a warm-up, after the
undecodable requests and after the control. Nothing of counterpoint is imported: run it
under any interpreter that has grpcio and protobuf.

The leak is grpcio's own path for a request its deserializer failed on (the deserializer
raised or returned None: `_server.py` then aborts with INTERNAL "Exception deserializing
request!"). ``--variant lenient`` is the work-around the grader servers use: a deserializer that
returns a marker object instead, and a handler that aborts with INVALID_ARGUMENT.
``--variant grader`` sends the same bytes to ``Grader/Score`` of counterpoint's own plain server
(`graders.service.start_server`, which uses that work-around); the control is a valid
ScoreRequest of an unknown case (NOT_FOUND).

    python bench/grpc_leak.py [--n 20000] [--warmup 2000] [--variant raise|lenient|grader]

Prints one JSON line: grpcio version, KiB per undecodable request and per good request.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from concurrent import futures

METHOD = "/leak.Probe/Call"
UNDECODABLE = b"\xff\xff\xff\xff\xff"  # field 31, wire type 7: no protobuf decodes this
GOOD = b"\x08\x01"  # Duration(seconds=1)


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def client(address: str, n: int, payload: bytes, method: str) -> None:
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        failed = 0
        for _ in range(n):
            try:
                call(payload, timeout=10)
            except grpc.RpcError:
                failed += 1
    print(failed)


def drive(address: str, n: int, payload: bytes, method: str = METHOD) -> int:
    """Send n requests from a fresh client process; the number that failed."""
    out = subprocess.run(
        [sys.executable, __file__, "--client", address, "--n", str(n), "--payload", payload.hex(),
         "--method", method],
        capture_output=True, text=True, check=True, timeout=3600,
    )
    return int(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--variant", choices=("raise", "lenient", "grader"), default="raise")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--method", default=METHOD, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client, args.n, bytes.fromhex(args.payload), args.method)
        return
    if args.variant == "grader":
        return grader(args)

    import grpc
    from google.protobuf import duration_pb2

    undecodable = object()  # not None: grpcio takes a None request for a failed decode

    def lenient(data: bytes):
        try:
            return duration_pb2.Duration.FromString(data)
        except Exception:
            return undecodable

    def call(request, context):
        if request is undecodable:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable request")
        return b""

    handler = grpc.method_handlers_generic_handler("leak.Probe", {
        "Call": grpc.unary_unary_rpc_method_handler(
            call,
            request_deserializer=(duration_pb2.Duration.FromString if args.variant == "raise"
                                  else lenient),
            response_serializer=None,
        ),
    })
    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        drive(address, args.warmup, UNDECODABLE)
        drive(address, args.warmup, GOOD)
        gc.collect()
        start = rss_kib()
        bad_failed = drive(address, args.n, UNDECODABLE)
        gc.collect()
        after_bad = rss_kib()
        good_failed = drive(address, args.n, GOOD)
        gc.collect()
        after_good = rss_kib()
    finally:
        server.stop(None)
    assert bad_failed == args.n and good_failed == 0, (bad_failed, good_failed)
    print(json.dumps({
        "grpcio": grpc.__version__,
        "variant": args.variant,
        "n": args.n,
        "rss_kib": [start, after_bad, after_good],
        "kib_per_undecodable_request": round((after_bad - start) / args.n, 3),
        "kib_per_good_request": round((after_good - after_bad) / args.n, 3),
    }))


def grader(args) -> None:
    """The same measurement against counterpoint's plain grader server."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import grpc

    from config.grader import GraderConfig
    from graders.proto import grader_pb2 as pb
    from graders.service import GraderCore, start_server
    from graders.tasks import make_task

    method = "/counterpoint.grader.v1.Grader/Score"
    good = pb.ScoreRequest(case_id="ghost", completion="[]").SerializeToString()
    server = start_server(GraderCore(make_task(GraderConfig())), "127.0.0.1", 0)
    try:
        drive(server.address, args.warmup, UNDECODABLE, method)
        drive(server.address, args.warmup, good, method)
        gc.collect()
        start = rss_kib()
        drive(server.address, args.n, UNDECODABLE, method)
        gc.collect()
        after_bad = rss_kib()
        drive(server.address, args.n, good, method)
        gc.collect()
        after_good = rss_kib()
    finally:
        server.stop(None)
    print(json.dumps({
        "grpcio": grpc.__version__,
        "variant": "grader",
        "n": args.n,
        "rss_kib": [start, after_bad, after_good],
        "kib_per_undecodable_request": round((after_bad - start) / args.n, 3),
        "kib_per_not_found_request": round((after_good - after_bad) / args.n, 3),
    }))


if __name__ == "__main__":
    main()
