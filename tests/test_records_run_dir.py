"""Run directory (records/) and the driver's archive policy on resume (services/archive.py):
JSONL durability, step bookkeeping, round files, superseded attempts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from records.jsonl import RecordError, append_jsonl, read_jsonl, repair_jsonl
from records.rows import NODE_FIELDS, node_id, node_row
from records.run_dir import RunDir
from services.archive import recover, supersede_after

REPO = Path(__file__).resolve().parents[1]
PHASES = {"gen": 1.5, "score": 0.2, "old_log_prob": 0.3, "ref": 0.0, "adv": 0.01,
          "update_actor": 2.0, "update_weights": 0.4}


def flat_rows(step: int, rewards: list[list[float]], adapter_version: int = 3) -> list[dict]:
    rows = []
    for group, group_rewards in enumerate(rewards):
        mean = sum(group_rewards) / len(group_rewards)
        for i, reward in enumerate(group_rewards):
            rows.append(node_row(
                id=node_id(step=step, round=0, group=group, index=i), step=step, exp_id="run-a",
                sibling_group=group,
                prompt_messages=[{"role": "user", "content": f"harmonise progression {group}"}],
                assistant_prefix='[{"measure": 1, "degrees": [' if i == 0 else "",
                prompt_token_ids=[1, 20 + group, 30 + i, 2],
                raw_completion=f"m1: C4 E4\n```sneaky```\nanswer {i}",
                response_token_ids=[5, 6, 7], response_logprobs=[-0.1, -0.2, -0.3],
                adapter_version=adapter_version, status="ok",
                verdict="admitted" if reward > 0 else "parallels,hidden",
                failing_rules=[] if reward > 0 else ["hidden", "parallels"],
                reward=reward, advantage=reward - mean, is_buggy=False, exec_time=0.01,
            ))
    return rows


# ------------------------------------------------------------------ JSONL


def test_torn_last_line_is_ignored_then_cut_and_appends_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    append_jsonl(path, {"step": 1})
    append_jsonl(path, {"step": 2})
    with open(path, "ab") as fh:
        fh.write(b'{"step": 3, "tot')  # SIGKILL mid-write
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    append_jsonl(path, {"step": 3})  # cuts the torn tail first, never glues onto it
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert path.read_text().count("\n") == 3


def test_complete_json_without_newline_counts_as_uncommitted(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    assert read_jsonl(path) == [{"step": 1}]
    assert repair_jsonl(path) == len('{"step": 2}')
    assert path.read_text() == '{"step": 1}\n'
    only_torn = tmp_path / "y.jsonl"
    only_torn.write_text('{"st')
    assert read_jsonl(only_torn) == [] and repair_jsonl(only_torn) == 4
    assert only_torn.read_bytes() == b""


def test_corrupt_line_in_the_middle_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(RecordError, match=r"x\.jsonl:2"):
        read_jsonl(path)


def test_sigkill_during_appends_leaves_a_recoverable_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # A child appends big timing lines as fast as it can; we SIGKILL it mid-stream.
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from records.run_dir import RunDir
        run = RunDir({str(run)!r}).create()
        print("ready", flush=True)
        step = 1
        while True:
            run.append_metrics(step, {{f"m{{i}}": float(i) for i in range(3000)}})
            run.append_timing(step, 1.0, {{"gen": 0.5}})
            step += 1
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        while RunDir(run).last_trained_step() < 3:
            assert child.poll() is None, "writer died on its own"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    rd = RunDir(run)
    dropped = recover(rd)
    assert set(dropped) == {"timing_torn_bytes", "metrics_torn_bytes", "metrics_uncommitted_lines"}
    trained = rd.trained_steps()
    assert trained == list(range(1, len(trained) + 1))
    supersede_after(rd, trained[-1])  # what resume does (from the last step's checkpoint)
    # Every metrics line left belongs to a committed step, once.
    assert [m["step"] for m in rd.metrics()] == trained
    assert rd.metrics_path.read_bytes().endswith(b"\n")
    # Resume continues the step count.
    nxt = rd.last_trained_step() + 1
    rd.append_metrics(nxt, {"reward_mean": 0.5})
    rd.append_timing(nxt, 2.0, PHASES)
    assert rd.trained_steps() == trained + [nxt]


# ------------------------------------------------------------------ step records


def test_recover_cuts_torn_lines_and_supersede_keeps_uncommitted_metrics(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    for step in (1, 2):
        rd.append_metrics(step, {"reward_mean": 0.1 * step, "ppl_ratio": 1.0})
        rd.append_timing(step, 3.0, PHASES)
    rd.append_metrics(3, {"reward_mean": 0.3})  # crash before the timing line of step 3
    with open(rd.timing_path, "ab") as fh:
        fh.write(b'{"step": 3, "total_s"')
    assert recover(rd) == {
        "timing_torn_bytes": len(b'{"step": 3, "total_s"'),
        "metrics_torn_bytes": 0,
        "metrics_uncommitted_lines": 1,
    }
    assert rd.last_trained_step() == 2
    dropped, attempt = supersede_after(rd, 2)
    assert dropped == [] and attempt == rd.root / "superseded" / "attempt_1"
    assert [m["step"] for m in rd.metrics()] == [1, 2]
    # The uncommitted line is kept aside, not lost.
    assert read_jsonl(attempt / "metrics.jsonl") == [{"step": 3, "reward_mean": 0.3}]
    assert json.loads((attempt / "superseded.json").read_text())["uncommitted_steps"] == [3]
    rd.append_metrics(3, {"reward_mean": 0.35})


def test_timing_rejects_unknown_phase_and_repeated_step(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    with pytest.raises(RecordError, match="generate"):
        rd.append_timing(1, 1.0, {"generate": 1.0})
    rd.append_timing(1, 1.0, {"gen": 1.0, "save_checkpoint": 0.2})
    with pytest.raises(RecordError, match="step 1 is not after"):
        rd.append_timing(1, 1.0, {"gen": 1.0})
    with pytest.raises(RecordError, match="scalars"):
        rd.append_metrics(2, {"histogram": [1, 2]})  # type: ignore[dict-item]


def test_paths_follow_design(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "r")
    assert rd.receipt_path.name == "run.json"
    assert rd.init_adapter_dir.relative_to(rd.root).as_posix() == "adapters/init"
    assert rd.adapter_dir(4).relative_to(rd.root).as_posix() == "adapters/step_4"
    assert rd.checkpoint_dir(4).relative_to(rd.root).as_posix() == "checkpoints/step_4"
    assert rd.heldout_path("before").relative_to(rd.root).as_posix() == "heldout_before.jsonl"
    assert rd.heldout_path("after").relative_to(rd.root).as_posix() == "heldout_after.jsonl"
    with pytest.raises(RecordError, match="'before' or 'after'"):
        rd.heldout_path("during")  # type: ignore[arg-type]
    paths = rd.round_paths(7, "voice-leading", 1)
    names = {k: p.relative_to(rd.root).as_posix() for k, p in paths.items()}
    assert names == {
        "rows": "round_7/voice-leading__1.jsonl",
        "transcript": "round_7/voice-leading__1__transcript.md",
        "tree": "round_7/voice-leading__1__tree.txt",
        "summary": "round_7/voice-leading__summary_1.json",
    }


# ------------------------------------------------------------------ rounds


def test_node_row_has_exactly_the_design_fields() -> None:
    row = flat_rows(1, [[1.0, 0.0]])[0]
    assert list(row) == list(NODE_FIELDS)
    assert len(NODE_FIELDS) == 23
    # What the model saw, beside what it wrote: prompt tokens and the forced prefix apart from the
    # sampled completion.
    assert row["assistant_prefix"] == '[{"measure": 1, "degrees": [' and row["prompt_token_ids"] == [1, 20, 30, 2]
    assert row["raw_completion"].startswith("m1: C4 E4")
    with pytest.raises(RecordError, match="no prompt_token_ids"):
        node_row(**{**row, "prompt_token_ids": []})
    assert row["mode"] == "sample" and row["parent_id"] is None and row["n_children"] == 0
    assert row["round"] == 0 and row["sibling_group"] == 0
    with pytest.raises(RecordError, match="3 response tokens but 2 log-probs"):
        node_row(**{**row, "response_logprobs": [-1.0, -2.0]})
    with pytest.raises(RecordError, match="mode"):
        node_row(**{**row, "mode": "explore"})


def test_write_round_files(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    rows = flat_rows(5, [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    paths = rd.write_round(5, "voice-leading", 1, rows)
    assert rd.read_round(5, "voice-leading", 1) == rows
    for line in paths["rows"].read_text().splitlines():
        assert set(json.loads(line)) == set(NODE_FIELDS)

    summary = json.loads(paths["summary"].read_text())
    assert summary["rows"] == 6 and summary["groups"] == 2
    assert summary["reward_mean"] == pytest.approx(2 / 6)
    assert summary["pass_rate"] == pytest.approx(2 / 6)
    assert summary["verdict_histogram"] == {"parallels,hidden": 4, "admitted": 2}
    assert summary["failing_rule_histogram"] == {"hidden": 4, "parallels": 4}
    assert summary["frac_reward_zero_std"] == 0.5
    assert summary["adapter_versions"] == [3]
    assert summary["status_counts"] == {"ok": 6} and summary["mode_counts"] == {"sample": 6}

    transcript = paths["transcript"].read_text()
    assert transcript.count("## Group ") == 2
    assert "harmonise progression 1" in transcript
    assert "s5-r0-g0-0 — reward 1.000, verdict `admitted`, advantage +0.333" in transcript
    # Shown verbatim inside a longer fence, so a completion cannot close the fence early.
    assert "````\nm1: C4 E4\n```sneaky```\nanswer 0\n````" in transcript
    # The forced prefix is shown apart from the sampled text, and the token counts with it.
    assert ('forced assistant prefix (not sampled):\n\n```\n[{"measure": 1, "degrees": [\n```\n\n'
            "````\nm1: C4 E4\n```sneaky```\nanswer 0") in transcript
    assert transcript.count("forced assistant prefix") == 2  # only the rows that had one
    assert "4 prompt + 3 response tokens" in transcript

    tree = paths["tree"].read_text().splitlines()
    assert tree[0] == "step 5  task voice-leading  epoch 1"
    assert tree[1] == "├── group 0  mean reward 0.667"
    assert tree[2].startswith("│   ├── s5-r0-g0-0 [sample] reward 1.000 adv +0.333 admitted")
    assert tree[5] == "└── group 1  mean reward 0.000"
    assert tree[-1].startswith("    └── s5-r0-g1-2")


def test_tree_nests_children_under_parents(tmp_path: Path) -> None:
    rows = flat_rows(2, [[0.0]])
    child = node_row(**{**rows[0], "id": "child", "parent_id": rows[0]["id"], "mode": "debug",
                        "reward": 1.0, "status": "ok", "is_buggy": False, "test_metric": 0.25},
                     tree=tree_fields())
    rows[0]["n_children"] = 1
    paths = RunDir(tmp_path).write_round(2, "voice-leading", 0, [rows[0], child])
    tree = paths["tree"].read_text().splitlines()
    assert tree[2].startswith("    └── s2-r0-g0-0 [sample]")
    # A tree row shows its mode, ok/BUGGY and the test value.
    assert tree[3].startswith("        └── child [debug] ok ok test 0.250 reward 1.000")


def tree_fields(**kw):
    from records.rows import TREE_FIELDS

    return {**{k: None for k in TREE_FIELDS}, "limits": {}, "code": "", "term_tail": "", **kw}


def test_tree_rows_need_the_tree_fields_and_flat_rows_refuse_them(tmp_path: Path) -> None:
    row = flat_rows(1, [[1.0]])[0]
    with pytest.raises(RecordError, match="tree fields"):
        node_row(**{**row, "mode": "draft"})  # a draft row without the tree fields
    with pytest.raises(RecordError, match="tree fields"):
        node_row(**row, tree=tree_fields())  # a sample row with them
    with pytest.raises(RecordError, match="tree fields"):
        node_row(**{**row, "mode": "draft"}, tree={"code": ""})  # only some of them
    draft = node_row(**{**row, "mode": "draft", "status": "crashed", "is_buggy": True},
                     tree=tree_fields(term_tail="Traceback: boom", exc_type="ValueError"))
    rd = RunDir(tmp_path)
    with pytest.raises(RecordError, match="unexpected fields"):
        rd.write_round(1, "code-exec", 0, [{**row, "code": ""}])
    paths = rd.write_round(1, "code-exec", 0, [draft], pass_verdicts=("ok",),
                           search_summary={"task": "pizza", "best_node_id": None, "nodes": 99},
                           tree_json='{"format": 1}')
    summary = json.loads(paths["summary"].read_text())
    assert (summary["case"], summary["best_node_id"], summary["rows"]) == ("pizza", None, 1)
    assert summary["task"] == "code-exec"  # the archive's keys win over the search summary's
    assert rd.tree_path(1).read_text() == '{"format": 1}\n'
    assert "[draft] BUGGY crashed test n/a" in paths["tree"].read_text()
    transcript = paths["transcript"].read_text()
    assert "exception ValueError" in transcript and "Traceback: boom" in transcript


def test_write_round_rejects_bad_rows(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    row = flat_rows(1, [[1.0]])[0]
    with pytest.raises(RecordError, match=r"missing fields \['verdict'\]"):
        rd.write_round(1, "voice-leading", 0, [{k: v for k, v in row.items() if k != "verdict"}])
    with pytest.raises(RecordError, match=r"unexpected fields \['extra'\]"):
        rd.write_round(1, "voice-leading", 0, [{**row, "extra": 1}])
    with pytest.raises(RecordError, match="other step numbers"):
        rd.write_round(2, "voice-leading", 0, [row])


def test_untrained_rounds(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    for step in (1, 2, 3):
        rd.write_round(step, "voice-leading", 0, flat_rows(step, [[1.0, 0.0]]))
    for step in (1, 2):
        rd.append_timing(step, 1.0, PHASES)
    (rd.root / "round_notes").mkdir()  # not a round
    assert rd.round_steps() == [1, 2, 3]
    assert rd.untrained_rounds() == [3]
    # A resume re-runs step 3 and overwrites its round in place.
    rd.write_round(3, "voice-leading", 0, flat_rows(3, [[0.0, 0.0]], adapter_version=2))
    assert {r["adapter_version"] for r in rd.read_round(3, "voice-leading", 0)} == {2}
    rd.append_timing(3, 1.0, PHASES)
    assert rd.untrained_rounds() == []


def test_supersede_after_moves_later_steps_aside(tmp_path):
    run = RunDir(tmp_path / "r").create()
    for step in (1, 2, 3):
        run.write_round(step, "voice-leading", 0, flat_rows(step, [[1.0, 0.0]]))
        run.append_metrics(step, {"reward_mean": 0.5})
        run.append_timing(step, 1.0, {"gen": 0.5})
        for kind in ("adapters", "checkpoints"):
            (run.root / kind / f"step_{step}").mkdir(parents=True)
            (run.root / kind / f"step_{step}" / "state.json").write_text(str(step))
    run.write_round(4, "voice-leading", 0, flat_rows(4, [[0.0, 1.0]]))  # generated, never trained
    rows_3 = run.read_round(3, "voice-leading", 0)
    assert supersede_after(run, 1) == ([2, 3], run.root / "superseded" / "attempt_1")
    assert run.trained_steps() == [1]
    assert [m["step"] for m in run.metrics()] == [1]
    assert run.round_steps() == [1]
    assert sorted(p.name for p in (run.root / "checkpoints").iterdir()) == ["step_1"]
    assert sorted(p.name for p in (run.root / "adapters").iterdir()) == ["step_1"]
    # Nothing is lost: the dead attempt's records sit in superseded/attempt_1, as they were.
    aside = run.root / "superseded" / "attempt_1"
    assert [r["step"] for r in read_jsonl(aside / "timing.jsonl")] == [2, 3]
    assert [r["step"] for r in read_jsonl(aside / "metrics.jsonl")] == [2, 3]
    assert RunDir(aside).round_steps() == [2, 3, 4]
    assert read_jsonl(aside / "round_3" / "voice-leading__0.jsonl") == rows_3
    assert (aside / "checkpoints" / "step_3" / "state.json").read_text() == "3"
    assert json.loads((aside / "superseded.json").read_text()) == {
        "reason": "resume", "resumed_from_step": 1, "trained_steps": [2, 3], "uncommitted_steps": [],
        "rounds": ["round_2", "round_3", "round_4"], "adapters": ["step_2", "step_3"],
        "checkpoints": ["step_2", "step_3"]}
    # The re-run steps can be recorded again without a duplicate; a second resume is attempt_2.
    run.append_timing(2, 1.0, {"gen": 0.5})
    assert run.trained_steps() == [1, 2]
    run.write_round(3, "voice-leading", 0, flat_rows(3, [[1.0, 1.0]]))
    assert supersede_after(run, 2)[1] == run.root / "superseded" / "attempt_2"
    assert supersede_after(run, 2) == ([], None)  # nothing after step 2 left to move
