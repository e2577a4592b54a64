"""The plain grpcio grader over a real loopback socket, called through the committed stubs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from graders.client import GraderClient, GraderRequestError, GraderUnavailable
from graders.metrics import start_metrics_server
from graders.proto import grader_pb2 as pb
from graders.proto import grader_pb2_grpc as pb_grpc
from config.grader import GraderConfig
from graders.tasks import make_task
from graders.service import SERVICE_NAME, GraderCore, start_server
from graders.voice_leading import score

REPO = Path(__file__).resolve().parents[1]

# Spec §14 example 11 (admitted) plus a plain cadence; served as a user fixture.
TINY = {
    "schema": "p4-progressions/1",
    "n": 2,
    "progressions": [
        {"songId": "rest-between", "genre": "t", "progression": {"key": "C major", "chords": [
            {"measure": 1, "chordSymbol": "C"}, {"measure": 2, "chordSymbol": "N/C"},
            {"measure": 3, "chordSymbol": "G"}]}},
        {"songId": "cadence", "genre": "t", "progression": {"key": "C major", "chords": [
            {"measure": 1, "chordSymbol": "C"}, {"measure": 2, "chordSymbol": "F"},
            {"measure": 3, "chordSymbol": "G7"}, {"measure": 4, "chordSymbol": "C"}]}},
    ],
}
ADMITTED = '[{"measure":1,"degrees":[0,2]},{"measure":3,"degrees":[0,1]}]'
COMPLETIONS = [
    ADMITTED,
    '[{"measure": 1, "degrees": [0, 0]}, {"measure": 2, "degrees": [0, 1]}, '
    '{"measure": 3, "degrees": [0, 1]}, {"measure": 4, "degrees": [1, 1]}]',
    "```json\n[{\"measure\": 1, \"degrees\": [0, 2]}]\n```",
    "I would write this in Python instead.",
    "",
]


@pytest.fixture(scope="module")
def tiny_fixture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "tiny.json"
    path.write_text(json.dumps(TINY), "utf-8")
    return path


@pytest.fixture(scope="module")
def server(tiny_fixture):
    core = GraderCore(make_task(GraderConfig(fixture=str(tiny_fixture), voices=2, style="common-practice")))
    running = start_server(core, "127.0.0.1", 0)
    yield running
    running.stop(None)


@pytest.fixture(scope="module")
def default_server():
    running = start_server(GraderCore(make_task(GraderConfig())))  # the default bind: no host, no port
    yield running
    running.stop(None)


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GraderStub(channel)


def _code(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


def _listening(port: int) -> list[str]:
    """The local addresses of every listening TCP socket (IPv4 and IPv6) on `port`, from the
    kernel's own table (/proc/net/tcp{,6}): where a server really bound, not what it says.
    IPv4-mapped IPv6 addresses (grpcio binds `127.0.0.1` as `::ffff:127.0.0.1`) read as IPv4."""
    import ipaddress

    out = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(table):
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)  # host-order 32-bit words
                ip = ipaddress.ip_address(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
                out.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return sorted(out)


# A second loopback address: Linux routes all of 127.0.0.0/8 to the loopback interface, so a
# server bound to 127.0.0.1 alone refuses it, and a server can bind it without any set-up. The
# tests never reach past loopback (no interface address of the machine is tried).
OTHER_LOOPBACK = "127.0.0.2"


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_default_bind_is_loopback_only(default_server):
    """start_server with no host binds 127.0.0.1 (the config's default) and nothing else: the
    kernel lists one listening socket on the port, on 127.0.0.1, and another address refuses a
    connection to it (an all-interfaces bind would answer on 127.0.0.2 too)."""
    port = default_server.port
    assert port > 0 and default_server.host == GraderConfig().host == "127.0.0.1"
    assert _listening(port) == ["127.0.0.1"]
    assert _reachable("127.0.0.1", port)
    assert not _reachable(OTHER_LOOPBACK, port), f"the default bind answers on {OTHER_LOOPBACK}"


def test_an_explicit_host_is_the_one_bound():
    """A host given (here a second loopback address) is where the server listens, and only
    there: Health answers on it, 127.0.0.1 refuses the port."""
    other = OTHER_LOOPBACK
    running = start_server(GraderCore(make_task(GraderConfig(fixture=None))), other, 0)
    try:
        assert (running.host, _listening(running.port)) == (other, [other])
        assert not _reachable("127.0.0.1", running.port)
        with GraderClient(f"{other}:{running.port}", max_retries=0, timeout_s=10) as client:
            assert client.health().task == "voice-leading"
    finally:
        running.stop(None)


def test_health_reports_pool_and_counters(stub):
    before = stub.Health(pb.HealthRequest(), timeout=10)
    assert (before.task, before.pool_size, before.pool_source) == ("voice-leading", 2, "fixture")
    assert (before.voices, before.style, before.checker) == (2, "common-practice", "reference")
    assert before.heldout_pool_size == 96 and dict(before.openings_histogram) == {16: 2}
    stub.ScoreBatch(pb.ScoreBatchRequest(requests=[
        pb.ScoreRequest(case_id="rest-between", completion=ADMITTED),
        pb.ScoreRequest(case_id="cadence", completion="no json here"),
    ]), timeout=10)
    after = stub.Health(pb.HealthRequest(), timeout=10).counters
    assert after.scored - before.counters.scored == 2
    assert after.unparsed - before.counters.unparsed == 1
    assert after.admitted - before.counters.admitted == 1


def test_default_pools_report_generated(default_server):
    with GraderClient(default_server.address) as client:
        health = client.health()
        assert (health.pool_size, health.pool_source, health.heldout_pool_size) == (48, "generated", 96)
        heldout = client.cases(3, "heldout")
    assert [c.id for c in heldout] == ["heldout-000", "heldout-001", "heldout-002"]


def test_cases_in_pool_order_with_prompt_fields(stub):
    reply = stub.Cases(pb.CasesRequest(limit=1), timeout=10)
    assert [c.id for c in reply.cases] == ["rest-between"] and reply.pool_size == 2
    case = reply.cases[0]
    assert (case.split, case.task, case.voices, case.chords) == ("train", "voice-leading", 2, 2)
    assert [m.role for m in case.messages] == ["system", "user"]
    assert "| 2 | N/C |" in case.messages[1].content
    assert len(case.openings) == 16 and case.openings[1] == "0,1"
    assert case.prefixes[1] == '[{"measure": 1, "degrees": [0, 1]},'
    assert [(c.measure, c.chord_symbol) for c in case.progression.chords] == [
        (1, "C"), (2, "N/C"), (3, "G")]
    everything = stub.Cases(pb.CasesRequest(), timeout=10)
    assert [c.id for c in everything.cases] == ["rest-between", "cadence"]


def test_cases_errors(stub):
    code, details = _code(stub.Cases, pb.CasesRequest(limit=3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "3" in details and "2" in details
    code, details = _code(stub.Cases, pb.CasesRequest(limit=1, split="dev"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dev" in details
    code, _ = _code(stub.Cases, pb.CasesRequest(limit=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("completion", COMPLETIONS)
@pytest.mark.parametrize("case_id", ["rest-between", "cadence"])
def test_score_matches_the_verifier(stub, case_id, completion):
    reply = stub.Score(pb.ScoreRequest(case_id=case_id, completion=completion), timeout=10)
    expected = score(TINY["progressions"][case_id == "cadence"]["progression"], completion, 2)
    assert reply.case_id == case_id and reply.status == "ok"
    assert (reply.reward, reply.format_ok, reply.admitted, reply.verdict) == (
        expected.reward, expected.format_ok, expected.admitted, expected.verdict)
    assert tuple(reply.failing_rules) == expected.failing_rules
    assert list(reply.failing_rules) == sorted(reply.failing_rules)
    assert (reply.sounding_frames, reply.expected_frames) == (
        expected.sounding_frames, expected.expected_frames)
    assert reply.opening == expected.opening and not reply.HasField("test_metric")
    assert json.loads(reply.details_json)["voice_count"] == expected.voice_count


def test_admitted_example(stub):
    reply = stub.Score(pb.ScoreRequest(case_id="rest-between", completion=ADMITTED), timeout=10)
    assert (reply.reward, reply.verdict, reply.sounding_frames, reply.expected_frames) == (
        1.0, "admitted", 2, 2)


def test_score_errors_never_unknown(stub):
    code, details = _code(stub.Score, pb.ScoreRequest(case_id="nope", completion="[]"))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
    code, details = _code(stub.Score, pb.ScoreRequest(completion="[]"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "case_id" in details
    batch = pb.ScoreBatchRequest(requests=[
        pb.ScoreRequest(case_id="cadence", completion="[]"),
        pb.ScoreRequest(case_id="cadence", completion="[]"),
        pb.ScoreRequest(case_id="ghost", completion="[]"),
    ])
    code, details = _code(stub.ScoreBatch, batch)
    assert code == grpc.StatusCode.NOT_FOUND and "requests[2]" in details and "ghost" in details


def test_score_batch_keeps_order(stub):
    pairs = [(cid, c) for c in COMPLETIONS for cid in ("cadence", "rest-between")]
    reply = stub.ScoreBatch(pb.ScoreBatchRequest(
        requests=[pb.ScoreRequest(case_id=i, completion=c) for i, c in pairs]), timeout=10)
    assert [r.case_id for r in reply.replies] == [i for i, _ in pairs]
    progs = {r["songId"]: r["progression"] for r in TINY["progressions"]}
    assert [r.verdict for r in reply.replies] == [score(progs[i], c).verdict for i, c in pairs]
    assert len(stub.ScoreBatch(pb.ScoreBatchRequest(), timeout=10).replies) == 0


def test_32_concurrent_clients(server):
    progs = {r["songId"]: r["progression"] for r in TINY["progressions"]}

    def one(k: int) -> list[tuple[str, float]]:
        pairs = [(("cadence", "rest-between")[(k + j) % 2], COMPLETIONS[(k + j) % 5])
                 for j in range(8)]
        with GraderClient(server.address) as client:
            got = client.score_batch(pairs)
        assert [(s.case_id, s.verdict) for s in got] == [
            (i, score(progs[i], c).verdict) for i, c in pairs]
        return [(s.case_id, s.reward) for s in got]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32 and all(len(r) == 8 for r in results)


def test_standard_health_service(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_services(server):
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        from google.protobuf.descriptor_pool import DescriptorPool

        described = DescriptorPool(database).FindServiceByName(SERVICE_NAME)
        assert [m.name for m in described.methods] == ["Health", "Cases", "Score", "ScoreBatch"]
        assert described.FindMethodByName("Score").output_type.fields_by_name["failing_rules"]


def test_client_raises_after_retries_on_a_dead_address():
    import socket

    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = GraderClient(f"127.0.0.1:{port}", max_retries=2, retry_backoff_s=0.01, timeout_s=2)
    with pytest.raises(GraderUnavailable, match="after 3 attempts: UNAVAILABLE"):
        client.score_batch([("x", "[]")])
    client.close()


def test_client_request_errors_are_not_retried(server):
    with GraderClient(server.address, max_retries=3) as client:
        with pytest.raises(GraderRequestError, match="FAILED_PRECONDITION") as err:
            client.cases(10)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        cases = client.cases(2)
        assert cases[0].progression == TINY["progressions"][0]["progression"]
        assert client.score(cases[0].id, ADMITTED).reward == 1.0


def test_prometheus_metrics_exposed(stub):
    port = start_metrics_server(0)
    stub.Score(pb.ScoreRequest(case_id="cadence", completion="not json"), timeout=10)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'counterpoint_grader_requests_total{task="voice-leading",verdict="structure"}' in body
    assert 'counterpoint_grader_latency_seconds_count{rpc="Score",task="voice-leading"}' in body


# --- the real CLI -----------------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "grader", *args]


def test_require_pool_refuses_before_serving(tiny_fixture):
    proc = subprocess.run(
        _cli("serve", "--fixture", str(tiny_fixture), "--require-pool", "3", "--port", "0"),
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "--require-pool 3" in proc.stderr and "holds only 2" in proc.stderr
    assert "serving" not in proc.stdout


def test_serve_refuses_another_schema(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({**TINY, "schema": "p5-something/1"}), "utf-8")
    proc = subprocess.run(_cli("serve", "--fixture", str(path), "--port", "0"), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not p4-progressions/1" in proc.stderr


def test_cli_serve_prints_address_and_serves(tiny_fixture):
    proc = subprocess.Popen(
        _cli("serve", "--fixture", str(tiny_fixture), "--require-pool", "2", "--port", "0",
             "--style", "film-ambient"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line + proc.stderr.read()
        address = line.split("serving on ")[1].split()[0]
        with GraderClient(address) as client:
            health = client.health()
            assert (health.pool_size, health.style) == (2, "film-ambient")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()
        proc.stderr.close()


class CountingClient(GraderClient):
    """The real client, counting the ScoreBatch requests it sends."""

    def __init__(self, address: str):
        super().__init__(address)
        self.batches: list[int] = []

    def score_batch(self, pairs):
        self.batches.append(len(pairs))
        return super().score_batch(pairs)


def test_grader_config_chunks_a_batch_for_its_replicas():
    assert GraderConfig(replicas=3).chunk_for(7) == 3
    assert GraderConfig(replicas=2, max_replicas=8).chunk_for(64) == 8
    assert GraderConfig().chunk_for(64) == 64  # one replica: one request
    assert GraderConfig(replicas=4, score_chunk=5).chunk_for(64) == 5
    assert GraderConfig(task="code-exec", replicas=4).chunk_for(64) == GraderConfig(task="code-exec").code_exec.max_concurrent
    # The chunk is the task section's max_concurrent, not a branch on a task's name: a task whose
    # section has none (vowel-share) splits the batch over replicas like voice-leading.
    code_exec = GraderConfig(task="code-exec")
    assert code_exec.task_section() is code_exec.code_exec
    assert GraderConfig(task="vowel-share", replicas=3).chunk_for(7) == 3
    assert GraderConfig(task="voice-leading").task_section() is None


def test_driver_scores_a_step_in_concurrent_chunks_in_order(server):
    """Serve routes a ScoreBatch whole to one replica, so the driver sends a step's batch as
    chunks (one per replica) at once; the replies come back in the batch's order."""
    from types import SimpleNamespace

    from rollout.types import Prompt, Sample
    from services.orchestrator import Rollouts, score as driver_score

    texts = [ADMITTED, "no json here", *COMPLETIONS]
    case_ids = [("rest-between", "cadence")[i % 2] for i in range(len(texts))]
    samples = [Sample(i, 0, t, [1], [2], [-0.1], "stop", 1) for i, t in enumerate(texts)]
    ro = Rollouts(1, case_ids, [Prompt(messages=({"role": "user", "content": "x"},))] * len(texts), samples,
                  list(range(len(texts))))
    with CountingClient(server.address) as client:
        parts = SimpleNamespace(cfg=SimpleNamespace(grader=GraderConfig(replicas=3)), grader=client,
                                    recoveries=None, grader_outages=None,
                                    grader_replaced=None)  # an external grader
        got = driver_score(parts, ro)
        batches = list(client.batches)
        one_by_one = [client.score(c, t) for c, t in zip(case_ids, texts)]
    n = len(texts)
    chunk = -(-n // 3)
    assert sorted(batches, reverse=True) == [chunk, chunk, n - 2 * chunk]
    assert [(s.case_id, s.reward, s.verdict) for s in got] == [(s.case_id, s.reward, s.verdict) for s in one_by_one]
