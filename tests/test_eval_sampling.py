"""`counterpoint eval` takes its sampling settings from one schema: the eval section, else the
rollout section; the receipt says where each value came from."""

from __future__ import annotations

from pathlib import Path

from config import load_config
from services.eval_run import eval_params, eval_sampling

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


def test_unset_eval_sampling_follows_the_rollout_section():
    cfg = load_config(SMOKE, ["rollout.temperature=0.7"])
    got = eval_sampling(cfg)
    assert got["max_tokens"] == {"value": 24, "source": "config rollout.max_tokens"}  # smoke.yaml sets it
    assert got["temperature"] == {"value": 0.7, "source": "config rollout.temperature"}
    assert got["top_p"] == {"value": 1.0, "source": "default rollout.top_p"}
    assert got["generations"] == {"value": 8, "source": "default eval.generations"}
    params = eval_params(got, [5])
    assert (params.n, params.max_tokens, params.temperature, params.top_k, params.stop_token_ids) == (8, 24, 0.7, -1, (5,))


def test_eval_section_and_command_line_win_and_say_so():
    cfg = load_config(SMOKE, ["eval.temperature=0.5", "eval.max_tokens=9", "eval.generations=2"])
    got = eval_sampling(cfg, frozenset({"generations"}))
    assert got["temperature"] == {"value": 0.5, "source": "config eval.temperature"}
    assert got["max_tokens"] == {"value": 9, "source": "config eval.max_tokens"}
    assert got["generations"] == {"value": 2, "source": "command line (eval.generations)"}
