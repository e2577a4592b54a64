"""The grader as a Ray Serve app (2 replicas) over Serve's gRPC ingress on 127.0.0.1."""

from __future__ import annotations

import socket

import grpc
import pytest

from graders.client import GraderClient, GraderRequestError
from graders.config import GraderConfig
from graders.service import SERVICE_NAME
from graders.voice_leading import score

APP = "grader-test"
ADMITTED_SHAPE = '[{"measure": 1, "degrees": [0, 1]}]'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_grader():
    import ray
    from ray import serve

    from graders import serve_app

    ray.init(num_cpus=2, include_dashboard=False)
    grpc_port = _free_port()
    try:
        handle = serve_app.start(
            GraderConfig(replicas=2, num_cpus=0.1),
            grpc_port=grpc_port, http_port=_free_port(), app_name=APP,
        )
        yield handle, f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


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
        "target_ongoing_requests": 8.0}
    scaled = deployment_options(GraderConfig(replicas=1, min_replicas=1, max_replicas=4,
                                             target_ongoing_requests=20, num_cpus=0.5))
    assert (scaled["autoscaling_config"]["max_replicas"], scaled["max_ongoing_requests"]) == (4, 40)
    assert scaled["ray_actor_options"] == {"num_cpus": 0.5}
    assert scaled["autoscaling_config"]["initial_replicas"] == 1


def test_client_from_config():
    cfg = GraderConfig(port=50999, max_retries=1, retry_backoff_s=0.25, timeout_s=3)
    client = GraderClient.from_config(cfg, application=cfg.app_name)
    assert (client.address, client.max_retries, client.retry_backoff_s, client.timeout_s) == (
        "127.0.0.1:50999", 1, 0.25, 3)
    assert client.metadata == (("application", "grader"),)
    client.close()
