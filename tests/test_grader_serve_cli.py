"""`counterpoint grader serve --ray --replicas 2` end to end: a real Serve app behind the
grpcio front on 127.0.0.1, scores spread over both replicas (per-replica Health counters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cliharness import LOOPBACK, listeners_of
from graders.client import GraderClient
from graders.voice_leading import score

REPO = Path(__file__).resolve().parents[1]
SHAPE = '[{"measure": 1, "degrees": [0, 1]}]'


@pytest.mark.slow
def test_grader_serve_ray_replicas_end_to_end(tmp_path):
    console = tmp_path / "stderr"  # what the replicas' logs bring to the console (log_to_driver)
    with open(console, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "grader", "serve", "--ray", "--replicas", "2",
             "--port", "0", "--metrics-port", "0"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        seen = []
        for line in proc.stdout:  # Ray may print before the address line
            seen.append(line)
            if "serving on" in line:
                break
        assert seen and "serving on 127.0.0.1:" in seen[-1], "".join(seen)
        assert "2 replica(s)" in seen[-1]
        (metrics_line,) = [line for line in seen if line.startswith("metrics on ")]
        # With --ray, /metrics carries the replica count read from Serve (graders/autoscale.py).
        with urllib.request.urlopen(metrics_line.split()[-1], timeout=30) as resp:
            exported = resp.read().decode()
        for sample in ('counterpoint_grader_replicas{state="running"} 2.0',
                       'counterpoint_grader_replica_bounds{bound="max"} 2.0',
                       'counterpoint_grader_scale_events_total{direction="up"} 0.0'):
            assert sample in exported, exported[-2000:]
        address = seen[-1].split("serving on ")[1].split()[0]
        with GraderClient(address, max_retries=2) as client:
            cases = client.cases(4)
            pairs = [(c.id, SHAPE) for c in cases] * 8
            batches = 24
            for _ in range(batches):
                got = client.score_batch(pairs)
                assert [s.verdict for s in got] == [
                    score(cases[i % 4].progression, SHAPE).verdict for i in range(len(pairs))]
            counters = {}
            for _ in range(60):  # Health answers from one replica at a time
                health = client.health()
                counters[health.replica] = health.counters["scored"]
                if len(counters) == 2:
                    break
        # The local cluster listens on loopback only (GCS, raylet, agents, metrics export, the
        # front), but for what Ray 2.60 hard-codes: each Serve replica's inter-deployment gRPC
        # server on [::]:0 (ray/serve/_private/replica.py), one per replica.
        listening = listeners_of(proc.pid)
        assert len(listening) >= 5, listening
        exposed = [x for x in listening if x[0] not in LOOPBACK]
        # Ray retitles a worker "ray::<actor>.<method>" while a call runs in it (a health check or
        # a late request can be in flight when the listeners are read), so the method is dropped.
        assert sorted(name.partition(".")[0] for _, _, name in exposed) == \
            ["ray::ServeReplica:grader:Grader"] * 2, exposed
        assert len(counters) == 2, counters
        assert all(n > 0 for n in counters.values()), counters  # both replicas scored
        assert sum(counters.values()) == batches * len(pairs)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        rest = proc.stdout.read()
        proc.stdout.close()
    assert code == 0
    # Serve's access log (a line per request, "CALL handle OK ...") stays off the console:
    # 24 batches and up to 60 Health calls went through the replicas above.
    shown = console.read_text() + "".join(seen) + rest
    assert not [line for line in shown.splitlines() if " CALL " in line], shown[-3000:]
