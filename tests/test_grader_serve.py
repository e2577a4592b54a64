"""The grader as a Ray Serve app (2 replicas) over both gRPC ingresses: Serve's own gRPC proxy
(the cluster manifests' path) and the grpcio front on 127.0.0.1 (`grader serve --ray`, a
trainer's own grader); replicas killed mid-call; the token, the size cap and undecodable
requests on both."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import psutil
import pytest

from graders.auth import TOKEN_METADATA
from graders.client import GraderClient, GraderRequestError
from config.grader import GraderConfig
from graders.proto import grader_pb2 as pb
from graders.service import SERVICE_NAME
from graders.voice_leading import score
from rayharness import local_ray

APP = "grader-test"
FRONT_APP = "grader-front"
TOKEN_APP = "grader-token"
ADMITTED_SHAPE = '[{"measure": 1, "degrees": [0, 1]}]'
SCORE = f"/{SERVICE_NAME}/Score"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_grader(request):
    from graders import serve_app

    with local_ray(request, num_cpus=2):
        grpc_port = _free_port()
        try:
            handle = serve_app.start(
                GraderConfig(replicas=2, num_cpus=0.1, serve_ingress="proxy"),
                grpc_port=grpc_port, http_port=_free_port(), app_name=APP,
            )
            yield handle, f"127.0.0.1:{grpc_port}"
        finally:
            for app in (FRONT_APP,):
                serve_app.stop_front(app)


@pytest.fixture(scope="module")
def front_grader(serve_grader):
    """The same cluster, a second app behind the grpcio front (the default ingress)."""
    from graders import serve_app

    handle = serve_app.start(GraderConfig(replicas=2, num_cpus=0.1), grpc_port=0,
                             app_name=FRONT_APP)
    return handle, serve_app.front_address(FRONT_APP)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "grader.token"
    path.write_text("correct-horse\n", "utf-8")
    return path


def _replica_processes(app: str) -> list[psutil.Process]:
    """This test's Serve replica workers of `app` (Ray titles them ray::ServeReplica:<app>:...);
    only descendants of this process, never another cluster on the machine."""
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(f"ray::ServeReplica:{app}:"):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_serve_grader_over_grpc_ingress(serve_grader):
    from ray import serve
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    handle, address = serve_grader
    deployment = serve.status().applications[APP].deployments["Grader"]
    assert deployment.replica_states.get("RUNNING") == 2

    with GraderClient(address, application=APP, max_retries=2, retry_backoff_s=0.2) as client:
        health = client.health()
        assert (health.task, health.pool_size, health.pool_source) == (
            "voice-leading", 48, "generated")
        cases = client.cases(4)
        assert [c.id for c in cases] == ["train-000", "train-001", "train-002", "train-003"]
        pairs = [(c.id, ADMITTED_SHAPE) for c in cases] + [(cases[0].id, "prose")]
        got = client.score_batch(pairs)
        assert [s.case_id for s in got] == [i for i, _ in pairs]
        expected = [score(c.progression, t) for c, t in zip(cases + cases[:1], [p[1] for p in pairs])]
        assert [(s.verdict, s.sounding_frames) for s in got] == [
            (e.verdict, e.sounding_frames) for e in expected]

        # Status codes survive Serve's proxy.
        for call, code in [
            (lambda: client.score("ghost", "[]"), grpc.StatusCode.NOT_FOUND),
            (lambda: client.score("", "[]"), grpc.StatusCode.INVALID_ARGUMENT),
            (lambda: client.cases(49), grpc.StatusCode.FAILED_PRECONDITION),
            (lambda: client.cases(1, "dev"), grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(GraderRequestError) as err:
                call()
            assert err.value.code == code, err.value

    with grpc.insecure_channel(address) as channel:
        # Serve's own health RPC (the proxy has no grpc.health.v1).
        reply = serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(
            serve_pb2.HealthzRequest(), timeout=30)
        assert reply.message == "success"
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        assert SERVICE_NAME in set(ProtoReflectionDescriptorDatabase(channel).get_services())

    # The handle path for in-cluster callers returns the client's typed values.
    scores = handle.score_batch.remote([(cases[1].id, ADMITTED_SHAPE)]).result()
    assert scores[0].case_id == cases[1].id and scores[0].verdict == got[1].verdict
    assert handle.health.remote().result().pool_size == 48


def test_deploy_config_validates_and_builds():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from graders.serve_app import GRPC_SERVICER_FN, app_builder

    path = Path(__file__).resolve().parents[1] / "deploy" / "serve" / "grader.yaml"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_FN]
    (application,) = schema.applications
    assert application.import_path == "graders.serve_app:app_builder"
    (deployment,) = application.deployments
    assert deployment.autoscaling_config["max_replicas"] >= deployment.autoscaling_config[
        "min_replicas"]
    built = app_builder(application.args)
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match="style"):
        app_builder({"style": "baroque"})


def test_deployment_options_from_config():
    from graders.serve_app import deployment_options

    fixed = deployment_options(GraderConfig(replicas=2))
    assert fixed["autoscaling_config"] == {
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 2,
        "target_ongoing_requests": 8.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
        "look_back_period_s": 30.0, "metrics_interval_s": 10.0}
    scaled = deployment_options(GraderConfig(replicas=1, min_replicas=1, max_replicas=4,
                                             target_ongoing_requests=20, num_cpus=0.5))
    assert (scaled["autoscaling_config"]["max_replicas"], scaled["max_ongoing_requests"]) == (4, 40)
    assert scaled["ray_actor_options"] == {"num_cpus": 0.5}
    assert scaled["autoscaling_config"]["initial_replicas"] == 1
    assert fixed["graceful_shutdown_wait_loop_s"] == 0.2  # grader.shutdown_poll_s, not Serve's 2 s
    quick = deployment_options(GraderConfig(upscale_delay_s=1, downscale_delay_s=2,
                                            look_back_period_s=12, metrics_interval_s=1))["autoscaling_config"]
    assert (quick["upscale_delay_s"], quick["downscale_delay_s"], quick["look_back_period_s"],
            quick["metrics_interval_s"]) == (1, 2, 12, 1)


def test_grader_defaults_are_serves_autoscaling_defaults():
    """Our stated defaults are what Serve would do unset, so a run's receipt is true to it."""
    from ray.serve.config import AutoscalingConfig

    serve_defaults, ours = AutoscalingConfig(), GraderConfig()
    for name in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s"):
        assert getattr(ours, name) == getattr(serve_defaults, name), name


def test_front_has_a_thread_for_every_call_the_app_can_take():
    """The front holds a grpcio thread per call in flight: with fewer than the app takes at
    max_replicas, Serve's autoscaler would never count enough ongoing requests to scale up."""
    from graders.serve_app import deployment_options, front_workers

    for cfg in (GraderConfig(), GraderConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=2),
                GraderConfig(max_replicas=4, target_ongoing_requests=20)):
        options = deployment_options(cfg)
        high = options["autoscaling_config"]["max_replicas"]
        assert front_workers(cfg) == high * options["max_ongoing_requests"]
        # enough in flight for the autoscaler to ask for every replica
        assert front_workers(cfg) >= high * cfg.target_ongoing_requests


def test_client_from_config():
    cfg = GraderConfig(port=50999, max_retries=1, retry_backoff_s=0.25, timeout_s=3)
    client = GraderClient.from_config(cfg, application=cfg.app_name)
    assert (client.address, client.max_retries, client.retry_backoff_s, client.timeout_s) == (
        "127.0.0.1:50999", 1, 0.25, 3)
    assert client.metadata == (("application", "grader"),)
    client.close()


# --- issue 11: replicas killed mid-call, the token, the size cap, undecodable requests ---------


@pytest.mark.slow
@pytest.mark.parametrize("ingress", ["proxy", "front"])
def test_scoring_survives_replicas_killed_mid_call(serve_grader, front_grader, ingress):
    """SIGKILL every replica of the app while four clients keep ScoreBatch calls in flight: the
    calls the kill hits fail (Serve's proxy: INTERNAL "actor died unexpectedly"; the front:
    UNAVAILABLE) and the client retries them within grader.max_retries until Serve has
    replaced the replicas; every call returns the verifier's scores."""
    app, address = (APP, serve_grader[1]) if ingress == "proxy" else (FRONT_APP, front_grader[1])
    application = APP if ingress == "proxy" else None
    with GraderClient(address, application=application) as probe:
        cases = probe.cases(8)
    completions = [ADMITTED_SHAPE, "prose", '[{"measure": 1, "degrees": [0, 0]}]',
                   '```json\n[{"measure": 2, "degrees": [1, 2]}]\n```']
    n = 6000  # about half a second of scoring per call here: the kill finds calls in flight
    pairs = [(cases[i % 8].id, completions[i % 4]) for i in range(n)]
    expected = [score(cases[i % 8].progression, completions[i % 4]).verdict for i in range(n)]

    done_before_kill = threading.Barrier(5)
    second_call_sent = [threading.Event() for _ in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []
    clients = [GraderClient(address, application=application, max_retries=8,
                            retry_backoff_s=0.5, timeout_s=60) for _ in range(4)]

    def keep_scoring(k: int, client: GraderClient) -> None:
        try:
            first = True
            while not stop.is_set():
                if not first:
                    second_call_sent[k].set()
                got = client.score_batch(pairs)
                assert [s.verdict for s in got] == expected
                if first:
                    done_before_kill.wait(timeout=300)
                    first = False
        except BaseException as exc:  # reported below with its type
            errors.append(exc)
            if first:
                done_before_kill.abort()

    threads = [threading.Thread(target=keep_scoring, args=(k, c)) for k, c in enumerate(clients)]
    for t in threads:
        t.start()
    victims: list[psutil.Process] = []
    try:
        done_before_kill.wait(timeout=300)  # every client has scored once
        for sent in second_call_sent:
            assert sent.wait(timeout=60)
        time.sleep(0.2)  # the four second calls are on the replicas now
        victims = _replica_processes(app)
        assert len(victims) == 2, victims
        for p in victims:
            p.kill()
        deadline = time.monotonic() + 240  # until Serve has replaced both, then a little more
        while time.monotonic() < deadline and not errors and len(_replica_processes(app)) < 2:
            time.sleep(1)
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
        for c in clients:
            c.close()
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert sum(c.retries for c in clients) >= 1, "no call was hit by the kill"
    survivors = {p.pid for p in _replica_processes(app)}
    assert len(survivors) == 2 and not survivors & {p.pid for p in victims}


@pytest.mark.slow
def test_front_binds_loopback_and_spreads_over_replicas(front_grader):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, address = front_grader
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1"
    listeners = {c.laddr for c in psutil.Process(os.getpid()).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)}
    assert listeners and all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1") for a in listeners)
    with GraderClient(address) as client:
        cases = client.cases(2)
        got = client.score_batch([(cases[0].id, ADMITTED_SHAPE), (cases[1].id, "prose")])
        assert [s.verdict for s in got] == [score(cases[0].progression, ADMITTED_SHAPE).verdict,
                                            "structure"]
        with pytest.raises(GraderRequestError) as err:
            client.score("ghost", "[]")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        # The front's handle learns its replicas from Serve's controller by long poll: right after
        # start it may still route every call to the one replica it knows (seen once in a clean
        # clone: 40 calls, one replica). Both must answer within the deadline, in batches of 40.
        replicas: set[str] = set()
        deadline = time.monotonic() + 60
        while len(replicas) < 2 and time.monotonic() < deadline:
            replicas |= {client.health().replica for _ in range(40)}
    assert len(replicas) == 2, replicas
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
@pytest.mark.parametrize("ingress", ["proxy", "front"])
def test_undecodable_and_oversized_requests(serve_grader, front_grader, ingress):
    """Never UNKNOWN: an undecodable request is INVALID_ARGUMENT on both ingresses; a request
    over grader.max_message_bytes (4 MiB) is RESOURCE_EXHAUSTED and not retried."""
    address = serve_grader[1] if ingress == "proxy" else front_grader[1]
    metadata = (("application", APP),) if ingress == "proxy" else ()
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary(SCORE)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=30, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "ScoreRequest" in err.value.details()
    with GraderClient(address, application=metadata[0][1] if metadata else None,
                      max_retries=3) as client:
        case_id = client.cases(1)[0].id
        assert client.score(case_id, "x" * (3 << 20)).verdict == "structure"  # under the cap
        with pytest.raises(GraderRequestError) as err:
            client.score(case_id, "x" * ((4 << 20) + 1))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.retries == 0


@pytest.mark.slow
def test_token_on_both_ingresses(serve_grader, token_file, tmp_path):
    """With grader.token_file set, Grader calls without the right x-counterpoint-token are
    UNAUTHENTICATED (checked by the front, or by the replicas behind Serve's proxy)."""
    from graders import serve_app

    proxy_address = serve_grader[1]
    cfg = GraderConfig(replicas=1, num_cpus=0.1, token_file=str(token_file))
    serve_app.start(cfg.model_copy(update={"serve_ingress": "proxy"}),
                    grpc_port=int(proxy_address.rsplit(":", 1)[1]), app_name=TOKEN_APP)
    front_app = TOKEN_APP + "-front"
    serve_app.start(cfg, grpc_port=0, app_name=front_app)
    try:
        for address, application in [(proxy_address, TOKEN_APP),
                                     (serve_app.front_address(front_app), None)]:
            for token in (None, "wrong"):
                with GraderClient(address, application=application, token=token,
                                  max_retries=2) as client:
                    with pytest.raises(GraderRequestError) as err:
                        client.health()
                    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                    assert "correct-horse" not in str(err.value)
            good = GraderClient.from_config(cfg, address=address, application=application)
            with good:
                assert good.health().pool_size == 48
                assert (TOKEN_METADATA, "correct-horse") in good.metadata
    finally:
        serve_app.stop_front(front_app)
        from ray import serve

        serve.delete(TOKEN_APP)
        serve.delete(front_app)


@pytest.mark.slow
def test_a_trainers_grader_serves_on_the_port_its_front_bound(serve_grader, monkeypatch):
    """services/launch.py start_grader: the front binds port 0 and reports the port it got. A
    port picked free first and bound later can be taken in between (a fresh-clone suite's run
    failed with PortInUse so); here every port the launcher could pick is already taken by
    the time it would bind, and the trainer's grader still serves."""
    from contextlib import ExitStack

    from ray import serve

    from config import RunConfig
    from graders import serve_app
    from services import launch

    app = "grader-trainer"
    with socket.socket() as held, ExitStack() as stack:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(launch, "free_port", lambda: taken)  # the race, made certain
        cfg = RunConfig(grader={"replicas": 1, "num_cpus": 0.1, "app_name": app})
        stack.callback(serve.delete, app)
        client = launch.start_grader(cfg, stack)
        host, port = client.address.rsplit(":", 1)
        assert (host, int(port)) == ("127.0.0.1", serve_app.front_port(app)) and int(port) != taken
        (case,) = client.cases(1)
        assert client.score(case.id, ADMITTED_SHAPE).verdict == score(case.progression,
                                                                     ADMITTED_SHAPE).verdict
    assert serve_app.front_port(app) is None  # the run's exit stopped its front
