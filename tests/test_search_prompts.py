"""search.prompts: what each mode shows, and what it must never show (the test metric)."""

from __future__ import annotations

import pytest

from config.search import SearchConfig
from search.prompts import FORMAT_INSTRUCTION, HEADINGS, fenced, mode_of, render_prompt
from records.exec_result import ExecResult
from search.tree import Node

CASE = {
    "id": "tabular-binary",
    "prompt_messages": [
        {"role": "system", "content": "You are an ML engineer. Answer in a ```python block."},
        {"role": "user", "content": "# tabular-binary\nPredict target.\n\n## Data preview\n\n- train.csv: 960 rows"},
    ],
    "task": {"id": "tabular-binary", "metric": "roc_auc", "direction": "higher"},
}


def mk(status="ok", code="import pandas as pd\nprint('hi')\n", val=0.6123456, test=0.9876, tail="",
       exc=None, message=None, raw=None):
    return Node(id="s1-r0-g0-0", parent_id=None, mode="draft", step=1, round=0, expansion=0, sibling_group=0,
                index=0, prompt_messages=[], assistant_prefix="",
                raw_completion=raw if raw is not None else f"```python\n{code}```", prompt_token_ids=[1],
                response_token_ids=[], response_logprobs=[], adapter_version=0, finish_reason="stop",
                result=ExecResult(task_id="t", status=status, reward=0.2, test_metric=test, val_metric=val,
                                  oriented=val, exec_time=0.1, term_tail=tail, exc_type=exc, message=message,
                                  isolation="none", limits={}, code=code))


def user(messages):
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0] == CASE["prompt_messages"][0]
    text = messages[1]["content"]
    assert text.startswith(CASE["prompt_messages"][1]["content"])  # description + data preview
    assert text.rstrip().endswith(FORMAT_INSTRUCTION)
    return text


def test_draft_prompt():
    msgs = render_prompt("draft", CASE, None, SearchConfig())
    text = user(msgs)
    assert HEADINGS["draft"] in text and mode_of(msgs) == "draft"
    assert CASE["prompt_messages"][1]["content"].endswith("960 rows")  # the case is not modified


def test_improve_prompt_shows_code_and_validation_metric_only():
    parent = mk()
    text = user(render_prompt("improve", CASE, parent, SearchConfig()))
    assert HEADINGS["improve"] in text and mode_of([{"content": text}]) == "improve"
    assert "```python\nimport pandas as pd\nprint('hi')\n```" in text
    assert "validation roc_auc was 0.612346 (higher is better)" in text and "raise it" in text
    assert "0.9876" not in text  # the test metric never reaches the policy
    lower = {**CASE, "task": {"metric": "rmsle", "direction": "lower"}}
    assert "lower it" in user(render_prompt("improve", lower, parent, SearchConfig()))
    with pytest.raises(ValueError, match="valid parent"):
        render_prompt("improve", CASE, mk(status="crashed", val=None), SearchConfig())


def test_debug_prompt_shows_code_failure_and_tail():
    tail = "x" * 5000 + "\nTraceback ...\nZeroDivisionError: division by zero\n"
    parent = mk(status="crashed", val=None, test=None, tail=tail, exc="ZeroDivisionError",
                message="exit status 1", code="print(1/0)\n")
    text = user(render_prompt("debug", CASE, parent, SearchConfig(debug_tail_chars=100)))
    assert HEADINGS["debug"] in text and "```python\nprint(1/0)\n```" in text
    assert "It failed: the script stopped with an error (ZeroDivisionError): exit status 1." in text
    assert "ZeroDivisionError: division by zero" in text and "x" * 101 not in text  # tail cut to 100
    none = user(render_prompt("debug", CASE, parent, SearchConfig(debug_tail_chars=0)))
    assert "Last lines" not in none
    with pytest.raises(ValueError, match="failed parent"):
        render_prompt("debug", CASE, mk(), SearchConfig())


def test_debug_of_a_no_code_answer_quotes_the_answer():
    parent = mk(status="no_code", code="", val=None, test=None, raw="I would fit a forest.",
                message="no fenced python block in the completion")
    text = user(render_prompt("debug", CASE, parent, SearchConfig()))
    assert "no script was found" in text and "I would fit a forest." in text
    assert "held no ```python code block" in text


def test_long_parent_code_is_cut_in_the_middle_and_fences_survive_backticks():
    code = "a = 1\n" * 10 + "s = '```'\n" + "b = 2\n" * 5000
    text = user(render_prompt("improve", CASE, mk(code=code), SearchConfig(max_parent_code_chars=500)))
    assert "characters cut" in text and "a = 1" in text and text.count("b = 2") < 100
    assert fenced("x = '```'", "python").startswith("````python\n")


def test_render_prompt_rejects_bad_modes():
    with pytest.raises(ValueError, match="needs a parent"):
        render_prompt("improve", CASE, None, SearchConfig())
    with pytest.raises(ValueError, match="draft\\|improve\\|debug"):
        render_prompt("sample", CASE, mk(), SearchConfig())
    with pytest.raises(ValueError, match="end with a user message"):
        render_prompt("draft", {**CASE, "prompt_messages": CASE["prompt_messages"][:1]}, None, SearchConfig())
