"""bench/memory.py's pure parts on CPU: nvidia-smi's output parsed; process names folded;
phases from TRL's marks (gpu_vs_trl.PhaseMarks) and from counterpoint's timing.jsonl, with
samples tagged by them; the peaks (total, per process, per phase); the JSON row's schema and
the report; and one sampled run end to end against a stand-in nvidia-smi (the child's pid seen,
a process already on the GPU left out, a run past its time stopped)."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_vs_trl import PhaseMarks
from bench.memory import (
    PHASES, ROW_KEYS, Sample, Sampler, TimingWatch, fold_name, make_row, markdown, measure, parse_compute_apps,
    parse_gpu_used, parse_phase_log, phase_at, replica_memory, report, summarize, train_transitions, trl_settings,
    validate_row, write,
)


def test_nvidia_smi_compute_apps_and_memory_used_are_parsed():
    text = "1234, 40960\n5678, [N/A]\n\n1234, 1024\nNo running processes found\n99,  512 \n"
    assert parse_compute_apps(text) == {1234: 41984.0, 99: 512.0}  # one pid on two GPUs: summed
    assert parse_compute_apps("") == {}
    assert parse_gpu_used("40000\n1000\n") == 41000.0
    assert parse_gpu_used("[N/A]\n") is None


def test_process_names_fold_ray_titles_scripts_and_spawned_children():
    assert fold_name(["ray::ServeReplica:counterpoint-rollout:RolloutReplica.handle_request"]) == \
        "ray::ServeReplica:counterpoint-rollout:RolloutReplica"
    assert fold_name(["ray::RayTrainWorker"]) == "ray::RayTrainWorker"
    assert fold_name(["/usr/bin/python3", "bench/gpu_vs_trl.py", "trl", "--vllm", "--shapes", "x"]) == \
        "python3 bench/gpu_vs_trl.py trl --vllm"
    assert fold_name(["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
                     parent="ray::ServeReplica:x:RolloutReplica") == "spawned by ray::ServeReplica:x:RolloutReplica"
    assert fold_name(["VLLM::EngineCore"]) == "VLLM::EngineCore"
    assert fold_name([]) == "" and fold_name([""]) == ""


def test_trls_phase_marks_nest_and_tag_the_samples(tmp_path):
    log = tmp_path / "phases"
    marks = PhaseMarks(str(log))
    clock = iter(range(100, 200))

    def stamped(phase):  # each mark a second apart, so the order is the file's
        with open(log, "a") as fh:
            fh.write(f"{next(clock)} {phase}\n")

    marks._write = stamped
    marks.enter("start")
    marks.enter("update")  # a step begins
    sync = marks.wrap("sync", lambda: None)
    generate = marks.wrap("generate", lambda: sync())
    score = marks.wrap("score", lambda: generate())
    score()
    marks.enter("end")
    got = parse_phase_log(log.read_text() + "garbage line here\n")
    assert [p for _, p in got] == ["start", "update", "score", "generate", "sync", "generate", "score", "update", "end"]
    assert phase_at(got, 50) == "start" and phase_at(got, 104.5) == "sync" and phase_at(got, 106) == "score"
    assert phase_at(got, 1e9) == "end"
    assert PhaseMarks(None).wrap("x", lambda: 7)() == 7  # without CP_PHASE_LOG: nothing written, same answer


def test_counterpoint_phases_are_laid_out_from_the_timing_lines():
    step = {"total_s": 10.0, "phases_s": {"gen": 4.0, "score": 0.5, "adv": 0.5, "old_log_prob": 0.0,
                                          "update_actor": 3.0, "update_weights": 1.0, "save_checkpoint": 0.0}}
    last = {**step, "phases_s": {**step["phases_s"], "save_checkpoint": 2.0}}
    tr = train_transitions([(1000.0, step), (1010.5, step), (1023.0, last)])
    assert tr[:5] == [(990.0, "generate"), (994.0, "score"), (995.0, "update"), (999.0, "sync"), (1000.0, "save")]
    # the next step starts where this one's line appeared (0.5 s the phases do not hold go to the learner)
    assert tr[5:10] == [(1000.0, "generate"), (1004.0, "score"), (1005.0, "update"), (1009.5, "sync"), (1010.5, "save")]
    assert tr[-2:] == [(1021.0, "save"), (1023.0, "end")]
    assert all(a[0] <= b[0] for a, b in zip(tr, tr[1:]))
    assert [phase_at(tr, t) for t in (980, 992, 994.5, 997, 999.5, 1012, 1022, 1030)] == \
        ["start", "generate", "score", "update", "sync", "generate", "save", "end"]
    # a step whose phases overrun the time between lines is clamped, never out of order
    odd = train_transitions([(100.0, step), (101.0, step)])
    assert all(a[0] <= b[0] for a, b in zip(odd, odd[1:])) and odd[-1] == (101.0, "end")
    assert train_transitions([]) == []


def test_timing_lines_are_taken_whole_with_the_time_they_were_seen(tmp_path):
    path = tmp_path / "timing.jsonl"
    watch = TimingWatch(path)
    watch(1.0)  # no file yet
    path.write_text('{"step": 1, "total_s": 2.0, "phases_s": {}}\n{"step": 2, "tot')
    watch(2.0)
    with open(path, "a") as fh:
        fh.write('al_s": 3.0, "phases_s": {}}\n')
    watch(3.0)
    watch(4.0)
    assert [(t, row["step"]) for t, row in watch.steps] == [(2.0, 1), (3.0, 2)]


def samples_of(rows):
    return [Sample(t, apps, used) for t, apps, used in rows]


def test_peaks_total_per_process_and_per_phase():
    samples = samples_of([
        (1.0, {10: 1000.0}, 1500.0),  # start
        (2.0, {10: 2000.0, 11: 500.0}, 3000.0),  # generate
        (3.0, {10: 2048.0, 11: 3072.0}, 5600.0),  # update: the peak total 5120 MiB = 5.0 GiB
        (4.0, {11: 3072.0}, None),  # end: 10 gone
    ])
    transitions = [(1.5, "generate"), (2.5, "update"), (3.5, "end")]
    got = summarize(samples, transitions, {10: "ray::RayTrainWorker"})
    assert got["total_gib"] == 5.0 and got["gpu_used_gib"] == round(5600 / 1024, 2)
    assert got["processes"] == [{"pid": 11, "name": "pid 11", "peak_gib": 3.0},
                                {"pid": 10, "name": "ray::RayTrainWorker", "peak_gib": 2.0}]
    assert list(got["phases_gib"]) == ["start", "generate", "update", "end"]  # PHASES order
    assert got["phases_gib"] == {"start": round(1000 / 1024, 2), "generate": round(2500 / 1024, 2), "update": 5.0,
                                 "end": 3.0}
    empty = summarize([], [], {})
    assert empty["total_gib"] is None and empty["processes"] == [] and empty["phases_gib"] == {}


def test_a_row_has_the_schema_and_the_report_renders_and_combines(tmp_path):
    figures = summarize(samples_of([(1.0, {10: 20480.0}, 21000.0)]), [], {10: "python3 bench/gpu_vs_trl.py trl"})
    row = make_row("qwen3-4b", 1, "trl_vllm", trl_settings(["--vllm-gpu-util", "0.09", "--checkpointing",
                                                             "--accumulate", "--vllm-sleep"], 1),
                   figures, 2.5312, "python3 bench/gpu_vs_trl.py trl --vllm", 0, None)
    assert list(row) == list(ROW_KEYS)
    assert row["settings"] == ("colocate, vllm_gpu_memory_utilization=0.09, gradient_checkpointing, "
                               "batch 8 x accumulation 1, vllm_enable_sleep_mode")
    assert (row["total_gib"], row["s_per_step"], row["group_size"], row["system"]) == (20.0, 2.531, 8, "trl_vllm")
    assert len(row["date"]) == 10 and row["phases_gib"] == {"start": 20.0}
    for bad in ({"system": "trl"}, {"total_gib": "20"}, {"prompts": 1.0}, {"date": "yesterday"},
                {"phases_gib": {"warmup": 1.0}}, {"processes": [{"pid": 1}]}):
        with pytest.raises(ValueError):
            validate_row({**row, **bad})
    with pytest.raises(ValueError, match="row keys"):
        validate_row({k: v for k, v in row.items() if k != "date"})
    other = {**row, "system": "counterpoint_train", "settings": "trainer.mode=sync", "total_gib": 39.8, "exit": 1,
             "error": "exit 1", "processes": [], "phases_gib": {p: 1.0 for p in PHASES}}
    versions = {"python": "3.12"}
    for name, rows in (("a", [row]), ("b", [other])):
        (tmp_path / name).mkdir()
        write(rows, f"call {name}", tmp_path / name, versions)
    md = (tmp_path / "a" / "memory.md").read_text()
    assert "| qwen3-4b | 1x8 | trl_vllm |" in md and "**20.0**" in md and "python3 bench/gpu_vs_trl.py trl" in md

    class Args:
        inputs = [tmp_path / "a" / "memory.json", tmp_path / "b" / "memory.json"]
        command = "calls a and b"
        out_dir = tmp_path / "out"

    assert report(Args) == 0
    doc = json.loads((tmp_path / "out" / "memory.json").read_text())
    assert [r["system"] for r in doc["rows"]] == ["trl_vllm", "counterpoint_train"]
    assert doc["command"] == "calls a and b" and doc["versions"] == versions
    assert "| 1 (exit 1) |" in markdown(doc)
    with pytest.raises(ValueError):
        write([{**row, "total_gib": "x"}], "c", tmp_path, versions)


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that prints the files the test writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apps, gpu = tmp_path / "apps.csv", tmp_path / "gpu.csv"
    apps.write_text("1, 5000\n")  # a process already on the GPU before the run
    gpu.write_text("5500\n")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$1" in --query-compute-apps*) cat {apps};; *) cat {gpu};; esac\n')
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return apps, gpu


def test_a_sampled_run_sees_its_child_leaves_out_what_was_there_and_stops_one_past_its_time(tmp_path, fake_smi):
    apps, gpu = fake_smi
    # Each state lasts 1.5 s: every sample spawns the fake nvidia-smi, which a loaded 2-core box
    # (the full suite beside other work) slowed past a 0.6 s window once
    child = ("import os, time, sys\n"
             f"open({str(apps)!r}, 'a').write(f'{{os.getpid()}}, 1024\\n'); time.sleep(1.5)\n"
             f"open({str(apps)!r}, 'a').write(f'{{os.getpid()}}, 2048\\n'); open({str(gpu)!r}, 'w').write('9000\\n')\n"
             "time.sleep(1.5)\n")
    t = time.monotonic()
    sampler, rc = measure([sys.executable, "-c", child], dict(os.environ), tmp_path / "run.log", 30, 0.1, None)
    assert rc == 0 and time.monotonic() - t < 20
    got = summarize(sampler.samples, [], sampler.names)
    assert len(sampler.samples) >= 5 and all(1 not in s.apps for s in sampler.samples)
    assert got["total_gib"] == 3.0  # the child's two rows (1024 + 2048 MiB) summed, pid 1 left out
    assert got["gpu_used_gib"] == round(9000 / 1024, 2)
    (proc,) = got["processes"]
    assert proc["name"].startswith("python") and "-c" in proc["name"]  # read from /proc/<pid>/cmdline

    t = time.monotonic()
    sampler, rc = measure([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                          tmp_path / "slow.log", 1, 0.1, None)
    assert rc == "timeout" and time.monotonic() - t < 15  # SIGINT ended it


def test_a_sampler_without_nvidia_smi_says_so():
    def missing():
        raise FileNotFoundError("nvidia-smi")

    sampler = Sampler(interval=0.05, query_apps=missing).start()
    time.sleep(0.2)
    sampler.stop()
    assert sampler.samples == [] and "FileNotFoundError" in sampler.error


def test_a_counterpoint_row_says_whether_the_base_was_shared(tmp_path):
    from bench.memory import base_weights_of

    assert base_weights_of(tmp_path) == "base weights: unknown (no run.json)"
    (tmp_path / "run.json").write_text(json.dumps({"base_weights": {"mode": "shared", "owner": "vllm replica"}}))
    assert base_weights_of(tmp_path) == "base weights shared with the replica"
    (tmp_path / "run.json").write_text(json.dumps({"base_weights": {"mode": "own", "reason": "share_base_weights=false"}}))
    assert base_weights_of(tmp_path) == "learner's own base copy (share_base_weights=false)"


def test_a_second_invocation_into_one_out_dir_keeps_the_first_ones_rows(tmp_path):
    """2026-12-03, call 14: the 14B run's memory.json overwrote the 32B run's, written a minute
    before into the same $OUT."""
    from bench.memory import earlier_rows, write

    assert earlier_rows(tmp_path) == []
    first = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "memory.json").read_text())["rows"][:1]
    write(first, "first call", tmp_path, {})
    assert earlier_rows(tmp_path) == first


def test_the_replica_report_keeps_vllms_memory_lines_and_torchs_view(tmp_path):
    """replica_memory: run.json's torch view of the replica beside vLLM's own memory lines from the
    run's logs, and nothing else of those logs (the first GPU report, 2026-12-03, also caught Ray's
    state dumps and the graph-capture progress bars)."""
    run = tmp_path / "run"
    (run / "logs" / "ray").mkdir(parents=True)
    view = {"start": {"allocated": 8.667, "reserved": 8.75}, "after_last_adapter": {"allocated": 8.913, "reserved": 9.199}}
    (run / "run.json").write_text(json.dumps({"rollout_engine": {"stats": {"device_memory_gib": view}}}))
    kept = ["(EngineCore pid=1) INFO [model_runner.py:305] Model loading took 7.56 GiB and 2.8 seconds",
            "(EngineCore pid=1) INFO [gpu_worker.py:560] Available KV cache memory: 1.01 GiB",
            "(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 7,344 tokens",
            "(EngineCore pid=1) INFO [model_runner.py:747] Graph capturing finished in 1 secs, took 0.12 GiB",
            "(EngineCore pid=1) INFO [gpu_worker.py:857] Free memory on device (139.29/139.8 GiB) on startup. "
            "Actual usage is 7.56 GiB for weight, 0.4 GiB for peak activation"]
    noise = ["2026-12-03 18:18:04,847\tINFO utils.py:352 -- Available modules: []",
             "[state-dump] \tObjectManager.UpdateAvailableMemory - 1 total (0 active)",
             "Capturing CUDA graphs (FULL):  50%|#####     | 2/4",
             "==== counterpoint train, pid 13899: counterpoint train --config configs/one-gpu-24gb.yaml"]
    (run / "logs" / "ray" / "worker-1.err").write_text("\n".join(noise[:2] + kept[:3] + noise[2:] + kept[3:]) + "\n")
    (run / "logs" / "driver.log").write_text(kept[0] + "\n")  # the same line twice: kept once
    found = replica_memory(run, tmp_path / "replica.json")
    assert found["torch"] == view
    assert found["vllm_log"] == kept
    assert json.loads((tmp_path / "replica.json").read_text()) == found
