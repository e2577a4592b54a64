"""The code-exec sandbox against hostile scripts: real processes, no mocks, each contained.

Every test runs real interpreters under the real namespaces of this host (the Sandbox refuses to
start below `min_isolation="namespaces"`), with a few seconds of wall clock per script.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from graders.code_exec import sandbox as sb
from config.code_exec import CodeExecConfig

REPO = Path(__file__).resolve().parents[1]


def _cfg(**kw) -> CodeExecConfig:
    base = dict(timeout_s=3.0, grace_s=0.5, cpu_s=20, memory_mb=512, nproc=16,
                output_limit_bytes=1 << 20, output_tail_bytes=2048, max_concurrent=2,
                queue_wait_s=5.0)
    base.update(kw)
    return CodeExecConfig(**base)


@pytest.fixture(scope="module")
def box() -> sb.Sandbox:
    return sb.Sandbox(_cfg())


@pytest.fixture()
def secret_task(tmp_path):
    """A task dir whose private/ answer holds a unique secret."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    pub, priv = tmp_path / "task" / "public", tmp_path / "task" / "private"
    pub.mkdir(parents=True)
    priv.mkdir()
    (pub / "train.csv").write_text("id,x\n1,2\n")
    (priv / "answers.csv").write_text(f"id,y\n1,{secret}\n")
    os.chmod(tmp_path, 0o755)
    return tmp_path / "task", secret


_present_before: set[int] = set()


@pytest.fixture(scope="module", autouse=True)
def _children_before_this_module():
    """Descendants this process already had (another module's Ray, say) are not this module's leaks."""
    _present_before.update(p.pid for p in psutil.Process().children(recursive=True))
    yield
    _present_before.clear()


def _no_children_left() -> bool:
    """No process descends from this one that this module started, zombies included: read from
    /proc (psutil), where waitpid(-1, WNOHANG) answers (0, 0) "yes, a child lives" and so could
    not tell a leak from none."""
    return not [p for p in psutil.Process().children(recursive=True) if p.pid not in _present_before]


def _host_pids_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


def test_the_leak_check_sees_a_planted_child():
    import subprocess
    import sys

    assert _no_children_left()
    leak = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _no_children_left()
        # The check this replaces: waitpid says (0, 0) while the child lives. Asked of this child's
        # pid, not of -1: -1 would reap any unreaped child an earlier test on this worker left
        # behind (seen in a fresh clone), both failing here and taking that test's exit status.
        assert os.waitpid(leak.pid, os.WNOHANG) == (0, 0)
    finally:
        leak.kill()
        leak.wait()
    assert _no_children_left()


def test_isolation_detected_and_reported(box):
    assert box.isolation == "namespaces"
    res, _, _ = box.run("print('hello')", None)
    assert (res.outcome, res.isolation, res.tail) == ("ok", "namespaces", "hello\n")
    assert res.limits["nproc"] == 16 and res.limits["address_space_bytes"] > res.limits["baseline_bytes"]
    assert _no_children_left()


def test_below_min_isolation_refuses_to_start():
    with pytest.raises(sb.IsolationUnavailable, match="below min_isolation='namespaces'"):
        sb.Sandbox(_cfg(isolation="none", min_isolation="namespaces"))


def test_environment_scrubbed_and_limits_applied(box, monkeypatch):
    monkeypatch.setenv("COUNTERPOINT_LEAK_CHECK", "leaked")
    code = (
        "import os, resource, json\n"
        "print(json.dumps({'env': dict(os.environ), 'uid': os.getuid(), 'cwd': os.getcwd(),\n"
        " 'as': resource.getrlimit(resource.RLIMIT_AS)[0],\n"
        " 'nproc': resource.getrlimit(resource.RLIMIT_NPROC)[0],\n"
        " 'fsize': resource.getrlimit(resource.RLIMIT_FSIZE)[0],\n"
        " 'nofile': resource.getrlimit(resource.RLIMIT_NOFILE)[0],\n"
        " 'cpu': resource.getrlimit(resource.RLIMIT_CPU)[0],\n"
        " 'pgid_is_sid': os.getpgid(0) == os.getsid(0) or os.getpid() == 1,\n"
        " 'caps': [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]}))\n"
    )
    res, _, _ = box.run(code, None)
    info = json.loads(res.tail)
    assert "COUNTERPOINT_LEAK_CHECK" not in info["env"]
    assert info["env"]["OMP_NUM_THREADS"] == info["env"]["OPENBLAS_NUM_THREADS"] == "1"
    assert info["cwd"] == "/workspace"
    assert info["uid"] != 0 and int(info["caps"], 16) == 0
    lim = box.limits
    assert (info["as"], info["nproc"], info["fsize"], info["nofile"], info["cpu"]) == (
        lim.address_space_bytes, lim.nproc, lim.file_size_bytes, lim.open_files, lim.cpu_s)


def test_fork_bomb_contained(box):
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    res, _, _ = box.run(code, None)
    assert res.outcome == "timeout"
    assert res.uid is not None and sb._pids_of_uid(res.uid) == []
    assert _no_children_left()
    assert box.run("print(1)", None)[0].outcome == "ok"  # the sandbox still works


def test_memory_bomb_is_a_memory_error():
    # The allocation loop touches all memory_mb before it fails: a wall limit longer than the
    # other tests' 3 s, so a loaded 2-core CI box cannot turn the MemoryError into a timeout.
    box = sb.Sandbox(_cfg(timeout_s=30.0))
    res, _, _ = box.run("x = bytearray(64 * 2**30)", None)
    assert (res.outcome, res.exc_type) == ("error", "MemoryError")
    res, _, _ = box.run("chunks = []\nwhile True:\n    chunks.append(bytearray(32 * 2**20))\n", None)
    assert (res.outcome, res.exc_type) == ("error", "MemoryError")


def test_infinite_loop_times_out(box):
    res, _, _ = box.run("while True:\n    pass\n", None)
    assert (res.outcome, res.exc_type) == ("timeout", "WallTimeout")
    assert res.exec_time >= box.limits.wall_s


def test_cpu_limit_is_a_timeout():
    box = sb.Sandbox(_cfg(cpu_s=1, timeout_s=8.0))
    res, _, _ = box.run("while True:\n    pass\n", None)
    assert (res.outcome, res.exc_type) == ("timeout", "CPUTimeLimit")


def test_sleep_past_timeout_ignoring_sigint(box):
    code = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "time.sleep(60)\n")
    res, _, _ = box.run(code, None)
    assert res.outcome == "timeout"
    assert _no_children_left()


def test_child_escaping_the_process_group_dies_with_the_run(box):
    marker = f"cp-escapee-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(300)', '{marker}'])\n"
        "    os._exit(0)\n"
        "import time; time.sleep(0.5)\n"
        "print('parent done')\n"
    )
    res, _, _ = box.run(code, None)
    assert res.outcome == "ok" and "parent done" in res.tail
    time.sleep(0.2)
    assert _host_pids_with(marker) == []


def test_no_network_outside_or_to_a_local_listener(box):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    code = (
        "import socket\n"
        "print('ifaces', sorted(n for _, n in socket.if_nameindex()))\n"
        f"for addr in [('127.0.0.1', {port}), ('192.0.2.1', 9)]:\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if addr[1] == 9 else socket.SOCK_STREAM)\n"
        "        s.settimeout(1); s.connect(addr)\n"
        "        if addr[1] != 9: s.sendall(b'x')\n"
        "        print('CONNECTED', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', addr, e.errno)\n"
    )
    try:
        res, _, _ = box.run(code, None)
        assert "ifaces ['lo']" in res.tail
        assert "CONNECTED" not in res.tail and res.tail.count("refused") == 2
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_private_answers_unreachable_by_any_path(box, secret_task):
    task, secret = secret_task
    code = f"""
import os, glob
TASK = {str(task)!r}
paths = ['../private/answers.csv', '../../private/answers.csv', '../task/private/answers.csv',
         TASK + '/private/answers.csv', '/proc/1/cwd/../private/answers.csv',
         '/proc/self/root' + TASK + '/private/answers.csv', '/proc/1/root' + TASK + '/private/answers.csv']
paths += ['/proc/%s/cwd/../private/answers.csv' % p for p in os.listdir('/proc') if p.isdigit()]
paths += ['/proc/%d/cwd/../private/answers.csv' % os.getppid()]
try:
    os.symlink(TASK + '/private/answers.csv', 'link.csv'); paths.append('link.csv')
    os.symlink(TASK, 'tasklink'); paths.append('tasklink/private/answers.csv')
except OSError as e:
    print('symlink', e)
import sys
skip = ('/proc', '/sys', '/usr', sys.prefix, sys.base_prefix)  # kernel views, the interpreter
for root, dirs, files in os.walk('/'):
    if root.startswith(skip):
        dirs[:] = []; continue
    paths += [os.path.join(root, f) for f in files if f == 'answers.csv']
tried = 0
for p in paths:
    tried += 1
    try:
        data = open(p).read()
        print('READ', p, data[:200])
    except OSError:
        pass
print('TRIED', tried)
"""
    res, _, _ = box.run(code, task / "public")
    assert res.outcome == "ok", res.tail
    assert "TRIED" in res.tail and int(res.tail.split("TRIED")[1].split()[0]) >= 9
    assert "READ" not in res.tail and secret not in res.tail


def test_writes_outside_the_workspace_never_reach_the_host(box, secret_task, tmp_path):
    task, _ = secret_task
    marker = f"cp-write-{uuid.uuid4().hex}"
    targets = [str(task / "public" / marker), str(task / marker), f"/tmp/{marker}",
               f"/work/{marker}", f"/{marker}", f"/etc/{marker}", f"../{marker}"]
    code = "import os\n" + "".join(
        f"try:\n    open({t!r}, 'w').write('x'); print('WROTE', {t!r})\nexcept OSError as e:\n    pass\n"
        for t in targets) + "print('end')\n"
    res, _, _ = box.run(code, task / "public")
    assert res.outcome == "ok" and "end" in res.tail
    for t in targets:
        host = t if t.startswith("/") else str(task / t)
        assert not os.path.exists(host), host
    assert _host_pids_with(marker) == []


def test_huge_stdout_is_cut_and_killed(box):
    res, _, _ = box.run("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", None)
    assert (res.outcome, res.exc_type) == ("output_limit", "OutputLimitExceeded")
    assert len(res.tail) <= box.limits.output_tail_bytes
    assert res.output_bytes > box.limits.output_limit_bytes


def test_script_deleting_its_own_workspace(box, secret_task):
    task, _ = secret_task
    code = ("import os, shutil\nfor e in os.listdir('.'):\n    os.remove(e)\n"
            "try:\n    shutil.rmtree(os.getcwd())\nexcept OSError as e:\n    print('rmtree', e.errno)\n"
            "print('left', os.listdir('/workspace'))\n")
    res, data, why = box.run(code, task / "public")
    assert res.outcome == "ok" and "left []" in res.tail
    assert data is None and why == "no submission.csv written"
    assert (task / "public" / "train.csv").is_file()  # the task's own copy is untouched


def test_symlinked_or_special_submission_is_not_followed(box, secret_task):
    task, secret = secret_task
    res, data, why = box.run(
        f"import os\nos.symlink({str(task / 'private' / 'answers.csv')!r}, 'submission.csv')\n",
        task / "public")
    assert res.outcome == "ok" and data is None and "cannot be opened safely" in why
    res, data, why = box.run("import os\nos.mkfifo('submission.csv')\n", task / "public")
    assert data is None and why == "submission.csv is not a regular file"


def test_slots_queue_then_resource_exhausted():
    box = sb.Sandbox(_cfg(max_concurrent=1, queue_wait_s=0.3))
    started = threading.Event()
    out = {}

    def long_run():
        started.set()
        out["first"] = box.run("import time; time.sleep(2)", None)[0].outcome

    t = threading.Thread(target=long_run)
    t.start()
    started.wait()
    time.sleep(0.3)
    with pytest.raises(sb.ResourceExhausted, match="1 execution slots busy"):
        box.run("print(1)", None)
    t.join()
    assert out["first"] == "ok"
    assert box.run("print(1)", None)[0].outcome == "ok"


def test_bare_level_still_limits_and_times_out():
    box = sb.Sandbox(_cfg(isolation="none", min_isolation="none", timeout_s=2.0))
    res, _, _ = box.run("import os\nprint(os.getcwd() != '/workspace')\nwhile True: pass\n", None)
    assert (res.outcome, res.isolation) == ("timeout", "none") and "True" in res.tail
    assert _no_children_left()


def test_exc_type_parsing():
    tail = 'Traceback (most recent call last):\n  File "x", line 1\nValueError: bad\n'
    assert sb.exc_type_of(tail, 1) == "ValueError"
    assert sb.exc_type_of("  File \"x\"\n    (\n    ^\nSyntaxError: '(' was never closed\n", 1) == "SyntaxError"
    assert sb.exc_type_of("", -9) == "SIGKILL"
    assert sb.exc_type_of("nothing", 3) is None


def test_read_regular_gives_a_reason_for_every_kind_of_file(tmp_path):
    """Whatever sits at the collected path is a reason, never an exception (os.mkdir of
    submission.csv used to raise IsADirectoryError out of the grader)."""
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "sock"))
    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "ok").write_bytes(b"id,y\n1,2\n")
    os.symlink(tmp_path / "ok", tmp_path / "link")
    try:
        got = {name: sb.read_regular(str(tmp_path / name), 100) for name in
               ("dir", "fifo", "sock", "big", "ok", "link", "missing")}
        got["device"] = sb.read_regular("/dev/zero", 100)  # a node the script cannot make, read all the same
        # procfs reports size 0 and then reads bytes: a file whose size changes under the read
        got["grows"] = sb.read_regular("/proc/self/status", 1 << 20)
    finally:
        unix.close()
    assert got["ok"] == (b"id,y\n1,2\n", None)
    for name in ("dir", "fifo"):
        assert got[name] == (None, f"{name} is not a regular file"), name
    assert got["device"] == (None, "zero is not a regular file")
    assert got["sock"][0] is None and "cannot be opened safely" in got["sock"][1]
    assert got["link"][0] is None and "cannot be opened safely" in got["link"][1]
    assert got["big"] == (None, "big is 101 bytes (limit 100)")
    assert got["missing"] == (None, "no missing written")
    assert got["grows"][0] is None and "changed while it was read" in got["grows"][1]


def test_workspace_quota_is_enospc_for_bytes_and_for_files():
    """The workspace is bounded in total, not per file (RLIMIT_FSIZE): 1 MiB files past
    workspace_mb fail with ENOSPC, and so do empty files past workspace_files. The loops stop
    at 3x the quota so the test cannot fill the host's disk where no quota holds."""
    box = sb.Sandbox(_cfg(workspace_mb=8, workspace_files=64))
    code = (
        "import errno, os\n"
        "written = 0\n"
        "for i in range(24):\n"
        "    try:\n"
        "        with open(f'big{i}', 'wb') as f:\n"
        "            f.write(b'x' * 2**20)\n"
        "        written += 2**20\n"
        "    except OSError as e:\n"
        "        print('bytes', errno.errorcode[e.errno], written)\n"
        "        break\n"
        "for name in os.listdir('.'):\n"
        "    os.remove(name)\n"
        "for i in range(192):\n"
        "    try:\n"
        "        open(f'f{i}', 'w').close()\n"
        "    except OSError as e:\n"
        "        print('files', errno.errorcode[e.errno], i)\n"
        "        break\n"
        "print('end')\n"
    )
    res, _, _ = box.run(code, None)
    assert res.outcome == "ok" and "end" in res.tail, res.tail
    words = {line.split()[0]: line.split()[1:] for line in res.tail.splitlines() if line.startswith(("bytes", "files"))}
    assert words["bytes"][0] == "ENOSPC" and int(words["bytes"][1]) < 8 * 2**20, res.tail
    assert words["files"][0] == "ENOSPC" and int(words["files"][1]) < 64, res.tail
    assert res.limits["workspace_bytes"] == 8 * 2**20 and res.limits["workspace_files"] == 64


def test_the_wrappers_own_lines_leave_the_tail():
    """unshare's report of a signal that lands mid-kill is not the script's output: a debug prompt
    shows the tail, and a resumed tree run must regrow the same prompts (tests/test_tree_driver.py)."""
    noisy = "step 1\nunshare: sigprocmask unblock failed: Invalid argument\nstep 2\n"
    assert sb.without_wrapper_lines(noisy) == "step 1\nstep 2\n"
    assert sb.without_wrapper_lines("unshare: sigprocmask unblock failed: Invalid argument\n") == ""
    assert sb.without_wrapper_lines("x = 'unshare: inside a line'\nno newline") == "x = 'unshare: inside a line'\nno newline"


def test_orphaned_run_dirs_are_this_hosts_of_dead_processes():
    alive = {10, 20}.__contains__
    names = ["cp-exec-h1_10_abc", "cp-exec-h1_30_x_y", "cp-exec-h1_40_", "cp-exec-h2_30_abc",
             "cp-exec-h1-5_30_abc", "cp-exec-h1_notapid_abc", "cp-exec-8c_3lwd", "other_30_x"]
    # h1's run dirs of dead pids 30 and 40; never host h2's, nor h1-5's (another host, whose name
    # starts like h1's), nor a name without a pid (the old cp-exec-<random> form)
    assert sb.orphaned_run_dirs(names, "h1", alive) == ["cp-exec-h1_30_x_y", "cp-exec-h1_40_"]
    assert sb.run_dir_prefix("h1", 30) == "cp-exec-h1_30_"


# A uid range of this test's own: a sandbox started meanwhile by another test of the suite (its
# default range) must not end this test's orphan before the test has seen it.
OWN_UIDS = {"uid_base": 64000, "uid_count": 8}


def _sandbox_uid_processes(cfg: CodeExecConfig) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"])
            if p.info["uids"] and cfg.uid_base <= p.info["uids"].real < cfg.uid_base + cfg.uid_count]


@pytest.mark.subprocess
def test_a_grader_killed_mid_run_takes_its_script_along_and_the_next_sandbox_removes_its_workspace(tmp_path):
    """A grader process killed with SIGKILL while a script runs never reaches its clean-up. Its
    script must not run on with nobody to enforce its wall clock (a sleep uses no CPU time: it
    would run forever): the wrapper's parent-death signal ends it at once, with no other sandbox
    started. The run directory (the workspace, with the task's files copied in) stays, and the
    next sandbox on the host removes it, and leaves a live process's run directory alone."""
    import subprocess
    import sys

    assert sb.parent_death_prefix()  # util-linux 2.38 here and on CI
    work = tmp_path / "work"
    work.mkdir()
    os.chmod(tmp_path, 0o755)
    code = (
        "from graders.code_exec import sandbox as sb\n"
        "from config.code_exec import CodeExecConfig\n"
        f"box = sb.Sandbox(CodeExecConfig(timeout_s=60.0, work_root={str(work)!r}, **{OWN_UIDS!r}))\n"
        "print('running', flush=True)\n"
        "box.run('import time; time.sleep(60)', None)\n"
    )
    grader = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert grader.stdout.readline().strip() == "running"
    cfg = _cfg(work_root=str(work), **OWN_UIDS)
    assert os.geteuid() == 0  # this box runs scripts under leased sandbox uids (as CI's does)
    deadline = time.monotonic() + 30
    while not _sandbox_uid_processes(cfg) and time.monotonic() < deadline:
        time.sleep(0.1)
    scripts = _sandbox_uid_processes(cfg)
    assert scripts
    (left,) = list(work.iterdir())
    assert left.name.startswith(sb.run_dir_prefix(socket.gethostname(), grader.pid))
    grader.kill()
    grader.wait()
    gone, alive = psutil.wait_procs(scripts, timeout=10)
    assert not alive and not _sandbox_uid_processes(cfg)
    assert left.is_dir()  # no clean-up ran
    live = work / f"{sb.run_dir_prefix(socket.gethostname(), os.getpid())}keep"
    live.mkdir()
    sb.Sandbox(cfg)
    assert not left.exists() and live.is_dir()


@pytest.mark.subprocess
def test_a_new_sandbox_kills_what_runs_under_a_sandbox_uid_that_nobody_leases():
    """The net under the parent-death signal (a util-linux without ``--pdeathsig``, a wrapper
    that outlived its grader some other way): a process under a sandbox uid whose lease nobody
    holds is an orphaned script's and is killed; one under a uid that a live sandbox leases is
    its running script's and is kept."""
    import subprocess

    cfg = _cfg(**OWN_UIDS)
    orphan_uid, leased_uid = cfg.uid_base + 1, cfg.uid_base + 2
    lease = sb._lock_uid(leased_uid)
    assert lease is not None
    procs = [subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"],
                              start_new_session=True) for uid in (orphan_uid, leased_uid)]
    try:
        deadline = time.monotonic() + 10
        while len(_sandbox_uid_processes(cfg)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.info["uids"].real for p in _sandbox_uid_processes(cfg)) == [orphan_uid, leased_uid]
        sb.Sandbox(cfg)
        assert procs[0].wait(timeout=10) == -9
        assert procs[1].poll() is None
    finally:
        os.close(lease)
        for p in procs:
            p.kill()
            p.wait()
