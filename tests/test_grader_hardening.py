"""Issue 11 over real sockets, plain grpcio server and CLI: one completion never fails a batch,
a held port is refused (plain and --ray, before Ray starts), the shared token, the size cap,
undecodable requests, which failures the client retries, and `--checker strict` served."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from graders.auth import TOKEN_METADATA, TokenError, resolve_token, token_ok
from graders.client import GraderClient, GraderRequestError, GraderUnavailable, retryable
from config.grader import GraderConfig
from graders.tasks import make_task
from graders.service import SERVICE_NAME, GraderCore, PortInUse, start_server
from graders.voice_leading import score

REPO = Path(__file__).resolve().parents[1]
BIG_KEY = '{"' + "1" * 5000 + '": [{"measure": 1, "degrees": [0, 2]}]}'  # issue 11's completion


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "grader", *args]


@pytest.fixture(scope="module")
def core():
    return GraderCore(make_task(GraderConfig()))


@pytest.fixture(scope="module")
def server(core):
    running = start_server(core, "127.0.0.1", 0)
    yield running
    running.stop(None)


def test_one_completion_past_pythons_limits_does_not_fail_the_batch(server):
    with GraderClient(server.address, max_retries=0) as client:
        cases = client.cases(2)
        pairs = [(cases[0].id, BIG_KEY), (cases[1].id, "[" * 100_000),
                 (cases[0].id, '[{"measure": 1, "degrees": [' + "9" * 5000 + "]}]")]
        got = client.score_batch(pairs)
    assert [s.status for s in got] == ["ok"] * 3
    assert [s.verdict for s in got] == [score(cases[i % 2].progression, t).verdict
                                        for i, (_, t) in enumerate(pairs)]


def test_a_huge_case_id_is_not_found_with_the_id_cut_not_resource_exhausted(server):
    """The error message used to echo the whole id: past grpc's metadata limit the client got
    RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead of NOT_FOUND."""
    from graders.service import MAX_DETAILS_CHARS

    huge = "x" * 20_000 + "-end"
    with GraderClient(server.address, max_retries=0) as client:
        for call in (lambda: client.score(huge, "[]"), lambda: client.score_batch([(huge, "[]")])):
            with pytest.raises(GraderRequestError) as info:
                call()
            assert info.value.code == grpc.StatusCode.NOT_FOUND, info.value
            details = str(info.value).split("NOT_FOUND: ", 1)[1]
            assert len(details) <= MAX_DETAILS_CHARS and "unknown case_id 'xxxx" in details, details[:300]
            assert "-end" not in details and "characters cut]" in details, details[-200:]
        assert client.health().task == "voice-leading"  # and the server is fine


def test_retryable_codes():
    # Idempotent RPCs: whatever may be the server's fault is retried, the request's is not.
    for code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN", "ABORTED"):
        assert retryable(getattr(grpc.StatusCode, code)), code
    for code in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "UNAUTHENTICATED",
                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "OUT_OF_RANGE"):
        assert not retryable(getattr(grpc.StatusCode, code)), code


def test_internal_is_retried_within_the_bound():
    """A server whose first two ScoreBatch calls die with INTERNAL (as Serve's proxy answers
    when the replica holding the call dies): the client's third attempt gets the scores; with
    max_retries=1 it gives up with GraderUnavailable."""
    calls = {"n": 0}

    def flaky(request: bytes, context):
        calls["n"] += 1
        if calls["n"] % 3:
            context.abort(grpc.StatusCode.INTERNAL, "actor died unexpectedly")
        return b""  # an empty ScoreBatchReply

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"ScoreBatch": grpc.unary_unary_rpc_method_handler(flaky)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with GraderClient(f"127.0.0.1:{port}", max_retries=4, retry_backoff_s=0.01) as client:
            assert client.score_batch([]) == []
            assert (client.retries, calls["n"]) == (2, 3)
        with GraderClient(f"127.0.0.1:{port}", max_retries=1, retry_backoff_s=0.01) as client:
            with pytest.raises(GraderUnavailable, match="after 2 attempts: INTERNAL"):
                client.score_batch([])
    finally:
        server.stop(None)


# --- one server per port ----------------------------------------------------------------------


@pytest.fixture()
def held_port():
    """A port held by a grpcio server that set SO_REUSEPORT (grpcio's default), as another
    grader would hold it."""
    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    yield port
    other.stop(None)


def test_second_server_on_a_held_port_is_refused(core, held_port):
    with pytest.raises(PortInUse, match=f"127.0.0.1:{held_port} is in use"):
        start_server(core, "127.0.0.1", held_port)


@pytest.mark.parametrize("ray", [False, True])
def test_cli_refuses_a_held_port_in_one_line(held_port, ray):
    """Exit 2 and one line naming the port, before anything starts (with --ray: before Ray)."""
    proc = subprocess.run(_cli("serve", "--port", str(held_port), *(["--ray"] if ray else [])),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --port {held_port}: 127.0.0.1:{held_port} is in use (another grader?); "
        "pick another, or 0 for a free one"]
    assert "serving" not in proc.stdout and "Ray" not in proc.stdout + proc.stderr


def test_cli_proxy_ingress_refuses_a_port_held_on_any_interface():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = subprocess.run(_cli("serve", "--ray", "--ingress", "proxy", "--port", str(port)),
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"[::]:{port} (Serve's gRPC proxy binds every interface) is in use" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# --- the shared token, the size cap, undecodable requests --------------------------------------


def test_resolve_token(tmp_path, monkeypatch):
    assert resolve_token(None, None) is None
    monkeypatch.setenv("CP_TEST_TOKEN", " s3cret\n")
    assert resolve_token("CP_TEST_TOKEN", None) == "s3cret"
    monkeypatch.setenv("CP_TEST_TOKEN", "")
    with pytest.raises(TokenError, match="token_env=CP_TEST_TOKEN: the variable is unset"):
        resolve_token("CP_TEST_TOKEN", None)
    path = tmp_path / "token"
    path.write_text("file-token\n")
    assert resolve_token(None, str(path)) == "file-token"
    with pytest.raises(TokenError, match="no-such"):
        resolve_token(None, str(tmp_path / "no-such"))
    assert token_ok(None, None) and token_ok("t", [(TOKEN_METADATA, "t")])
    assert not token_ok("t", [(TOKEN_METADATA, "u")]) and not token_ok("t", [("other", "t")])
    with pytest.raises(ValueError, match="not both"):
        GraderConfig(token_env="A", token_file="/b")


def test_token_required_on_grader_calls_only(core, monkeypatch):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    monkeypatch.setenv("CP_TEST_TOKEN", "s3cret")
    cfg = GraderConfig(token_env="CP_TEST_TOKEN", max_retries=3, retry_backoff_s=0.01)
    running = start_server(core, "127.0.0.1", 0, token=resolve_token(cfg.token_env, None))
    try:
        for token in (None, "wrong"):
            with GraderClient(running.address, token=token, max_retries=3) as client:
                with pytest.raises(GraderRequestError) as err:
                    client.cases(1)
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert "s3cret" not in str(err.value) and client.retries == 0
        with GraderClient.from_config(cfg, address=running.address) as client:
            assert client.cases(1)[0].id == "train-000"
        with grpc.insecure_channel(running.address) as channel:  # probes stay open
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop(None)


def test_size_cap_and_undecodable_requests(core):
    running = start_server(core, "127.0.0.1", 0, max_message_bytes=64 * 1024)
    try:
        with GraderClient(running.address, max_retries=2) as client:
            case_id = client.cases(1)[0].id
            assert client.score(case_id, "x" * 60_000).verdict == "structure"
            with pytest.raises(GraderRequestError) as err:
                client.score(case_id, "x" * 70_000)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and client.retries == 0
        with grpc.insecure_channel(running.address) as channel:
            for rpc in ("Score", "ScoreBatch", "Cases"):
                with pytest.raises(grpc.RpcError) as err:
                    channel.unary_unary(f"/{SERVICE_NAME}/{rpc}")(b"\xff\xff\xff", timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # never UNKNOWN
                assert f"{rpc}Request" in err.value.details()
    finally:
        running.stop(None)


def test_default_size_cap_is_the_config_field(core):
    running = start_server(core, "127.0.0.1", 0)
    limit = GraderConfig().max_message_bytes
    try:
        with GraderClient(running.address, max_retries=0) as client:
            case_id = client.cases(1)[0].id
            with pytest.raises(GraderRequestError) as err:
                client.score(case_id, "x" * limit)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running.stop(None)


def test_cli_refuses_an_unset_token_env():
    env = {k: v for k, v in os.environ.items() if k != "CP_UNSET_TOKEN"}
    proc = subprocess.run(_cli("serve", "--port", "0", "--token-env", "CP_UNSET_TOKEN"),
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: grader.token_env=CP_UNSET_TOKEN: the variable is unset or empty")


# --- `--checker strict` through the service ------------------------------------------------------

# Reference reads "1" and "3" through Number() and admits; strict refuses coerced numbers.
COERCED = '[{"measure": "1", "degrees": [0, 2]}, {"measure": 3, "degrees": ["0", 1]}]'


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(_cli("serve", "--port", "0", *args), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    assert "serving on 127.0.0.1:" in line, line + proc.stderr.read()
    return proc, line.split("serving on ")[1].split()[0]


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    proc.stdout.close()
    proc.stderr.close()


def test_checker_strict_through_the_service(tmp_path):
    import json

    pool = {"schema": "p4-progressions/1", "n": 1, "progressions": [
        {"songId": "rest-between", "genre": "t", "progression": {"key": "C major", "chords": [
            {"measure": 1, "chordSymbol": "C"}, {"measure": 2, "chordSymbol": "N/C"},
            {"measure": 3, "chordSymbol": "G"}]}}]}
    fixture = tmp_path / "one.json"
    fixture.write_text(json.dumps(pool), "utf-8")
    progression = pool["progressions"][0]["progression"]
    assert score(progression, COERCED, checker="reference").reward == 1.0
    assert score(progression, COERCED, checker="strict").reward == 0.0
    rewards = {}
    for checker in ("reference", "strict"):
        proc, address = _serve("--fixture", str(fixture), "--checker", checker)
        try:
            with GraderClient(address) as client:
                assert client.health().checker == checker
                (got,) = client.score_batch([("rest-between", COERCED)])
                rewards[checker] = (got.reward, got.verdict)
        finally:
            _stop(proc)
    assert rewards == {"reference": (1.0, "admitted"), "strict": (0.0, "structure")}


def test_line_budget_admits_per_second_and_summarises_the_rest():
    from graders.native_log import LineBudget

    budget = LineBudget(3)
    got = [budget.offer(f"l{i}\n".encode(), 10.0 + i * 0.1) for i in range(6)]
    assert [keep for keep, _ in got] == [True, True, True, False, False, False]
    assert all(summary is None for _, summary in got)
    keep, summary = budget.offer(b"next\n", 11.5)  # a new second: the old one's drops summarised
    assert keep and summary == b"counterpoint: 3 more lines of native (grpc-core) log dropped (over 3/s); the last: l5\n"
    assert budget.close() is None


def test_grpc_core_log_of_a_grader_is_rate_limited(tmp_path):
    """`grader serve` under a load that makes grpc-core log per frame (its own http tracer: the
    real C++ log path a frame flood drives) writes at most native_log_lines_per_s of it a second,
    saying how many it dropped, and keeps answering."""
    import time

    from graders.ports import free_port

    port = free_port()
    err_path = tmp_path / "stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "debug", "GRPC_TRACE": "http"}
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(_cli("serve", "--port", str(port), "--set", "native_log_lines_per_s=20"), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            assert "serving on" in proc.stdout.readline()
            t0 = time.monotonic()
            with GraderClient(f"127.0.0.1:{port}", max_retries=0) as client:
                case = client.cases(1)[0]
                for _ in range(150):
                    assert client.score_batch([(case.id, "[]")] * 4)[0].case_id == case.id
            elapsed = time.monotonic() - t0
            time.sleep(1.5)  # a quiet second: the summary of the last busy one is written
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    lines = err_path.read_bytes().splitlines()
    dropped = [line for line in lines if b"lines of native (grpc-core) log dropped" in line]
    assert dropped, lines[-5:]
    total_dropped = sum(int(line.split(b": ", 1)[1].split()[0]) for line in dropped)
    assert total_dropped > 1000, total_dropped  # the load did make grpc-core log per frame
    assert len(lines) <= 20 * (elapsed + 4) + len(dropped) + 20, (len(lines), elapsed)
