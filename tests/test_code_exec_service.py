"""The `code-exec` task over real sockets: the plain grpcio server and `grader serve --ray
--replicas 2`, with real sandboxed executions; the CLI's list / score; RESOURCE_EXHAUSTED past
the per-replica limit; a host below the minimum isolation refuses to start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from config.grader import GraderConfig
from graders.client import GraderClient, GraderRequestError
from graders.code_exec.build import build_tasks
from graders.code_exec.ladder import as_completion, ladder_script
from graders.code_exec.sandbox import detect_isolation
from graders.code_exec.service import IsolationRefused
from graders.spread import score_spread, sized_chunks
from graders.service import GraderCore, start_server
from graders.tasks import make_task, task_names
from cliharness import REPO, cli

TASKS = ["docs-topic", "positive-regression", "tabular-binary"]


def _py(code: str) -> str:
    return f"My script:\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> str:
    return str(build_tasks(tmp_path_factory.mktemp("ce-service") / "tasks", seed=0))


def _server(tasks_dir: str, **code_exec):
    cfg = GraderConfig(task="code-exec", code_exec={"tasks_dir": tasks_dir, "grace_s": 0.5, **code_exec})
    return start_server(GraderCore(make_task(cfg)), "127.0.0.1", 0)


@pytest.fixture(scope="module")
def client(tasks_dir):
    # 10 s of wall time: the ok script imports pandas, which can take seconds on a loaded CI box
    server = _server(tasks_dir, timeout_s=10.0, sentinel=-0.25)
    with GraderClient(server.address, max_retries=0) as c:
        yield c
    server.stop(None)


def test_registered_and_health_reports_isolation(client):
    assert "code-exec" in task_names()
    health = client.health()
    assert (health.task, health.pool_size, health.heldout_pool_size) == ("code-exec", 3, 3)
    assert health.details["isolation"] == detect_isolation()[0] == "namespaces"
    assert health.details["tasks"] == TASKS and health.details["sentinel"] == -0.25


def test_health_says_which_grading_rules_grade(client, tasks_dir, tmp_path):
    """Health's checker (what the run receipt records as checker and grader_health.checker) and
    details name the rule set; tasks under different rule sets are listed task by task."""
    health = client.health()
    assert health.checker == "counterpoint"
    assert health.details["grading_rules"] == {t: "counterpoint" for t in TASKS}
    assert health.details["grading_rules_default"] == "mle-bench"
    assert all(c.details["grading_rules"] == "counterpoint" for c in client.cases(0, "train"))
    mixed = tmp_path / "tasks"
    for tid in ("tabular-binary", "docs-topic"):
        shutil.copytree(Path(tasks_dir) / tid, mixed / tid)
    tj = mixed / "docs-topic" / "task.json"
    tj.write_text(json.dumps({k: v for k, v in json.loads(tj.read_text()).items() if k != "grading_rules"}))
    core = GraderCore(make_task(GraderConfig(task="code-exec", code_exec={"tasks_dir": str(mixed)})))
    assert core.health_record().checker == "docs-topic=mle-bench,tabular-binary=counterpoint"


def test_cases_carry_prompt_and_task_metadata(client):
    cases = client.cases(0, "heldout")
    assert [c.id for c in cases] == TASKS and {c.split for c in cases} == {"heldout"}
    system, user = cases[2].messages
    assert "submission.csv" in system["content"] and "train.csv" in user["content"]
    assert (cases[2].details["metric"], cases[2].details["direction"]) == ("roc_auc", "higher")
    for limit, split, code in ((4, "train", "FAILED_PRECONDITION"), (0, "val", "INVALID_ARGUMENT")):
        with pytest.raises(GraderRequestError) as info:
            client.cases(limit, split)
        assert info.value.code.name == code


def test_statuses_and_sentinel_over_grpc(client):
    invalid = "import pandas as pd\npd.DataFrame({'id': [1], 'target': [0.5]}).to_csv('submission.csv', index=False)"
    pairs = [
        ("positive-regression", as_completion(ladder_script("constant", "rmsle"))),
        ("docs-topic", "I would use a random forest."),
        ("tabular-binary", _py("raise KeyError('boom')")),
        ("tabular-binary", _py("import time\ntime.sleep(60)")),
        ("tabular-binary", _py(invalid)),
    ]
    ok, no_code, crashed, timeout, bad = client.score_batch(pairs)
    assert (ok.status, ok.verdict, ok.format_ok, ok.admitted) == ("ok", "ok", True, True)
    assert ok.test_metric > 0 and 0 < ok.reward < 1 and ok.details["val_metric"] > 0
    assert ok.details["isolation"] == "namespaces" and ok.details["limits"]["wall_s"] == 10.0
    assert [s.status for s in (no_code, crashed, timeout, bad)] == [
        "no_code", "crashed", "timeout", "invalid_submission"]
    for s in (no_code, crashed, timeout, bad):
        assert (s.reward, s.test_metric, s.format_ok, s.admitted, s.verdict) == (-0.25, None, False, False, s.status)
    assert crashed.details["exc_type"] == "KeyError" and "boom" in crashed.details["term_tail"]
    assert timeout.details["exec_time"] >= 10.0 and "rows" in bad.details["message"]
    with pytest.raises(GraderRequestError) as info:
        client.score_batch([("tabular-binary", "x"), ("no-such-task", "x")])
    assert info.value.code.name == "NOT_FOUND" and "requests[1]" in str(info.value)


PLANTED = {  # what a script may leave where its submission.csv belongs
    "directory": "import os\nos.mkdir('submission.csv')",
    "fifo": "import os\nos.mkfifo('submission.csv')",
    "symlink": "import os\nos.symlink('/etc/passwd', 'submission.csv')",
    "socket": "import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('submission.csv')",
    # not creatable in the sandbox (no CAP_MKNOD): the script leaves nothing
    "device": "import os, stat\ntry:\n    os.mknod('submission.csv', stat.S_IFCHR | 0o600, os.makedev(1, 5))\n"
              "except OSError as e:\n    print('mknod', e.errno)",
    # a writer left behind that keeps growing the file once the script has exited
    "growing": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    f = open('submission.csv', 'a')\n"
               "    while True:\n        f.write('id,target\\n'); f.flush()\n"
               "time.sleep(0.5)",
    "wide header": "open('submission.csv', 'w').write(','.join('c%d' % i for i in range(1_000_000)) + '\\n')",
    "wide row": "open('submission.csv', 'w').write('id,target\\n' + ','.join(['1'] * 3_000_000) + '\\n')",
}


def test_whatever_a_script_leaves_is_that_scripts_status_alone(client):
    """One batch over the real gRPC service: every kind of thing a script can leave in place of
    submission.csv gets invalid_submission for that script alone, and its siblings still score
    (a directory used to fail the whole ScoreBatch with INTERNAL; a 1-million-column header or a
    3-million-field row kept the grader's pandas busy for minutes)."""
    ok_script = as_completion(ladder_script("constant", "roc_auc"))
    pairs = [("tabular-binary", ok_script), *(("tabular-binary", _py(code)) for code in PLANTED.values()),
             ("tabular-binary", ok_script)]
    t0 = time.monotonic()
    got = client.score_batch(pairs)
    elapsed = time.monotonic() - t0
    assert [s.status for s in (got[0], got[-1])] == ["ok", "ok"] and got[0].test_metric == 0.5
    planted = dict(zip(PLANTED, got[1:-1], strict=True))
    assert {k: s.status for k, s in planted.items()} == {k: "invalid_submission" for k in PLANTED}
    messages = {k: s.details["message"] for k, s in planted.items()}
    assert messages["directory"] == messages["fifo"] == "submission.csv is not a regular file", messages
    assert "cannot be opened safely" in messages["symlink"] and "cannot be opened safely" in messages["socket"]
    assert messages["device"] == "no submission.csv written" and "mknod 1" in planted["device"].details["term_tail"]
    assert messages["wide header"] == "line 1 has 1000000 fields, over the 1026 read (2 columns + 1024)"
    assert messages["wide row"] == "line 2 has 3000000 fields, over the 1026 read (2 columns + 1024)"
    assert elapsed < 60, elapsed  # the wide files are refused before pandas reads them
    assert "rows, expected 640" in messages["growing"]  # nothing of the script outlives it: a stable file, graded
    assert client.health().counters["scored"] >= len(pairs)


def test_resource_exhausted_past_the_limit(tasks_dir):
    """One slot, a 0.3 s queue wait: the second of two concurrent scripts is refused."""
    before = REGISTRY.get_sample_value(
        "counterpoint_grader_executions_total", {"task": "code-exec", "status": "overloaded"}) or 0
    server = _server(tasks_dir, max_concurrent=1, queue_wait_s=0.3, timeout_s=20.0)
    results: list = []
    barrier = threading.Barrier(2)

    def one():
        barrier.wait()
        try:
            results.append(client.score("tabular-binary", _py("import time\ntime.sleep(4)")).status)
        except GraderRequestError as exc:
            results.append(exc.code.name)

    try:
        with GraderClient(server.address, max_retries=0, timeout_s=60) as client:
            threads = [threading.Thread(target=one) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(results) == ["RESOURCE_EXHAUSTED", "invalid_submission"]
            assert client.health().counters["scored"] == 1  # still healthy
    finally:
        server.stop(None)
    after = REGISTRY.get_sample_value(
        "counterpoint_grader_executions_total", {"task": "code-exec", "status": "overloaded"})
    assert after == before + 1
    assert REGISTRY.get_sample_value("counterpoint_grader_isolation_level", {"task": "code-exec"}) == 1


def test_below_min_isolation_refuses_to_start(tasks_dir):
    cfg = GraderConfig(task="code-exec", code_exec={"tasks_dir": tasks_dir, "isolation": "none"})
    with pytest.raises(IsolationRefused, match="below min_isolation='namespaces'"):
        make_task(cfg)
    run = cli("grader", "serve", "--task", "code-exec", "--port", "0",
              "--set", f"code_exec.tasks_dir={tasks_dir}", "--set", "code_exec.isolation=none", timeout=120)
    assert run.returncode == 2 and "code-exec refuses to start" in run.stderr and "serving" not in run.stdout


def test_task_files_larger_than_the_workspace_refuse_to_start(tasks_dir, tmp_path):
    big = Path(shutil.copytree(tasks_dir, tmp_path / "tasks"))
    (big / "docs-topic" / "public" / "extra.bin").write_bytes(b"\0" * (2 * 2**20))
    run = cli("grader", "serve", "--task", "code-exec", "--port", "0", "--set", f"code_exec.tasks_dir={big}",
              "--set", "code_exec.workspace_mb=2", timeout=120)
    assert run.returncode == 2 and "serving" not in run.stdout, run.stderr
    assert "task docs-topic: its public files (2.2 MiB, 5 files) do not fit the workspace" in run.stderr, run.stderr


def test_cli_list_and_score(tasks_dir):
    listed = cli("grader", "list", "--task", "code-exec", "--set", f"code_exec.tasks_dir={tasks_dir}")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["id"] for r in rows] == TASKS and rows[0]["metric"] == "log_loss" and rows[2]["direction"] == "higher"
    lines = [json.dumps({"task_id": "tabular-binary", "completion": as_completion(ladder_script("constant", "roc_auc"))}),
             "{not json", json.dumps({"task_id": "docs-topic", "completion": _py("print('hi')\n1/0")}),
             json.dumps({"task_id": "no-such-task", "completion": ""})]
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "grader", "score", "--task", "code-exec",
         "--set", f"code_exec.tasks_dir={tasks_dir}"],
        cwd=REPO, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ok, malformed, crashed, unknown = [json.loads(line) for line in run.stdout.splitlines()]
    assert (ok["status"], ok["reward"], ok["test_metric"]) == ("ok", 0.0, 0.5) and ok["exec_time"] > 0
    assert malformed["line"] == 2 and "JSONDecodeError" in malformed["error"]
    assert (crashed["status"], crashed["reward"], crashed["test_metric"]) == ("crashed", -0.5, None)
    assert "hi" in crashed["term_tail"] and "ZeroDivisionError" in crashed["term_tail"]
    assert unknown["line"] == 4 and "no-such-task" in unknown["error"]


def test_sized_chunks():
    assert sized_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)] and sized_chunks(0, 3) == []
    with pytest.raises(ValueError):
        sized_chunks(3, 0)


@pytest.mark.slow
def test_grader_serve_ray_two_replicas_spreads_a_batch(tasks_dir):
    """`grader serve --task code-exec --ray --replicas 2`: a batch sent as chunks runs on both
    replicas (each reply names the process that ran it), in order, with real executions."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "grader", "serve", "--task", "code-exec", "--ray",
         "--replicas", "2", "--port", "0", "--set", f"code_exec.tasks_dir={tasks_dir}",
         "--set", "code_exec.max_concurrent=1", "--set", "replica_memory_mb=256"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "serving on" in line:
                break
        assert seen and "serving on 127.0.0.1:" in seen[-1], "".join(seen)
        address = seen[-1].split("serving on ")[1].split()[0]
        with GraderClient(address, max_retries=2, timeout_s=120) as client:
            assert client.health().details["isolation"] == "namespaces"
            pairs = [("tabular-binary", _py(f"import time\ntime.sleep(1.5)\nprint({i})")) for i in range(4)]
            pairs.append(("docs-topic", "no code"))
            got = score_spread(client, pairs, chunk=1)
        assert [s.status for s in got] == ["invalid_submission"] * 4 + ["no_code"]
        assert [s.details["term_tail"].strip() for s in got[:4]] == ["0", "1", "2", "3"]
        assert len({s.details["worker"] for s in got}) == 2  # both replicas ran scripts
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        proc.stdout.close()
    assert code == 0
