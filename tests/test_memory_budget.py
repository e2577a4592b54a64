"""A memory budget a user states (the run's gpu_memory_gib): the split between vLLM and the
learner (services/memory_budget.py, pure), vLLM's fraction from an amount, and the refusals
before any service starts (config validation, services/preflight.py apply_memory_budget, the
CLI's --dry-run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config, resolved
from learner.memory_plan import fixed_bytes, lora_params, memory_plan
from rollout.engines.vllm_engine import gpu_memory_fraction
from services.memory_budget import (GIB, BudgetTooSmall, LearnerNeeds, ReplicaNeeds, fixed_micro_batch_tokens,
                                    learner_minimum_bytes, model_shape, parameter_count, split_for_run, split_memory)
from services.preflight import PreflightError, apply_memory_budget

REPO = Path(__file__).resolve().parents[1]
ONE_GPU = REPO / "configs" / "one-gpu-24gb.yaml"

# config.json fields of the real models (the bench's random-init shapes are the same)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
LLAMA_UNTIED = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=100)  # no head_dim, no key-value heads, no tie flag: derived, MHA, untied


@pytest.mark.parametrize("config, params", [
    # Hugging Face's counts (4,022,468,096 and 596,049,920) less Qwen3's q/k norms (2 x 128 per layer)
    (QWEN3_4B, 4_022_468_096 - 36 * 256),
    (QWEN3_06B, 596_049_920 - 28 * 256),
    # 2 layers x (4 x 64 x 64 + 3 x 64 x 128 + 2 x 64) + embeddings and head 2 x 100 x 64 + final norm 64
    (LLAMA_UNTIED, 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 100 * 64 + 64),
])
def test_parameter_count_from_config_json(config, params):
    assert parameter_count(config) == params


def test_qwen3_4b_shape_and_lora():
    shape = model_shape(QWEN3_4B, 2)
    assert (shape.q_dim, shape.kv_dim, shape.layers) == (4096, 1024, 36)
    assert lora_params(shape, 32, "all-linear") == 66_060_288  # r x (in + out) over 7 x 36 linears
    assert round(shape.params * 2 / GIB, 2) == 7.49


def test_a_multimodal_wrapper_is_measured_by_its_language_model():
    """Gemma 3 / Qwen2.5-VL config.json keep the LM under text_config, and may keep the tie flag on
    the wrapper: the shape is the inner model's, its head tied as the wrapper says."""
    inner = {k: v for k, v in QWEN3_4B.items() if k != "tie_word_embeddings"}
    wrapped = {"architectures": ["Qwen3VLForConditionalGeneration"], "tie_word_embeddings": True,
               "text_config": inner, "vision_config": {"hidden_size": 1152}}
    assert model_shape(wrapped, 2) == model_shape(QWEN3_4B, 2)
    untied = model_shape({"text_config": inner}, 2)  # no flag anywhere: untied, the safe side
    assert untied.params == model_shape(QWEN3_4B, 2).params + 151936 * 2560


def _replica(**changes) -> ReplicaNeeds:
    base = dict(sequences=8, sequence_tokens=640, merged=True, cuda_graphs=True, w0_on_device=False,
                lora_slots=2, lora_slot_rank=32)
    return ReplicaNeeds(**{**base, **changes})


def _learner(**changes) -> LearnerNeeds:
    base = dict(rank=32, targets="all-linear", micro_batch_tokens=640, logprob_chunk_tokens=128, checkpointing=None)
    return LearnerNeeds(**{**base, **changes})


# budget, model, replica changes, learner changes ->
#   (vLLM GiB, learner GiB, KV sequences, learner checkpoints, learner tokens per micro-batch) or the refusal's need
SPLITS = [
    # configs/one-gpu-24gb.yaml: Qwen3-4B, 1 x 8 x (~200 + 384 in 640), merged LoRA, log-prob slices of 128
    (22, QWEN3_4B, {}, {}, (9.19, 10.98, 8, True, 931)),
    (24, QWEN3_4B, {}, {}, (9.19, 12.98, 8, True, 2659)),
    (21.3, QWEN3_4B, {}, {}, (8.82, 10.65, 3, True, 646)),  # just above the minimum: the KV cache gets what is left
    (21, QWEN3_4B, {}, {}, 21.1),
    (12, QWEN3_4B, {}, {}, 21.1),
    (22, QWEN3_4B, {}, {"logprob_chunk_tokens": 256}, (9.04, 11.13, 6, True, 643)),  # larger slices: less KV cache
    (22, QWEN3_4B, {"w0_on_device": True}, {}, 27.9),  # rollout.merged_w0=device: the model again
    (24, QWEN3_4B, {"merged": False}, {}, (9.44, 13.31, 8, True, 2944)),  # vLLM's LoRA slots inside its budget
    (24, QWEN3_4B, {}, {"checkpointing": False}, 24.8),  # one 640-token row without checkpointing
    (40, QWEN3_4B, {}, {"checkpointing": False}, (9.19, 28.98, 8, False, 2773)),
    (8, QWEN3_06B, {}, {}, (2.65, 3.98, 8, False, 722)),  # 0.6B: one row without checkpointing at 8 ...
    (12, QWEN3_06B, {}, {}, (2.65, 7.98, 8, False, 2220)),  # ... three at 12
    (6, QWEN3_06B, {}, {}, 6.2),
    # checkpointing=auto weighing the step's 8 rows (micro_batch_tokens=auto): checkpointing where it
    # takes them in fewer micro-batches, not only where one row would not fit without it
    (12, QWEN3_06B, {}, {"rows": 8}, (2.65, 7.98, 8, True, 7151)),  # 3 rows a plain micro-batch; all 8 checkpointed
    (40, QWEN3_4B, {}, {"rows": 8}, (9.19, 28.98, 8, True, 16482)),  # 4 plain; 8 checkpointed
    (40, QWEN3_4B, {}, {"rows": 8, "max_rows": 4}, (9.19, 28.98, 8, False, 2773)),  # 4 a micro-batch either way
    (60, QWEN3_4B, {}, {"rows": 8}, (9.19, 48.98, 8, False, 5680)),  # all 8 fit one plain micro-batch
]


@pytest.mark.parametrize("budget, config, replica, learner, expected", SPLITS)
def test_split_table(budget, config, replica, learner, expected):
    shape = model_shape(config, 2)
    rep, lrn = _replica(**replica), _learner(**learner)
    if isinstance(expected, float):
        with pytest.raises(BudgetTooSmall) as info:
            split_memory(budget, "qwen3", shape, rep, lrn)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"gpu_memory_gib={budget:g} cannot hold qwen3 twice")
        assert message.endswith(f"needs >= {expected:.1f} GiB"), message
        return
    split = split_memory(budget, "qwen3", shape, rep, lrn)
    got = (split.rollout_gib, split.learner_gib, split.kv_sequences, split.learner_checkpointing,
           split.learner_micro_batch_tokens)
    assert got == expected, split.summary()
    # the parts fit the budget, and the learner's own plan fits one micro-batch in its share
    assert split.rollout_gib + split.learner_gib + split.rollout_outside_gib + split.contexts_gib <= budget + 1e-9
    assert split.minimum_gib <= budget + 0.05 and split.learner_gib >= split.learner_minimum_gib - 0.01
    trainable = lora_params(shape, lrn.rank, lrn.targets)
    plan = memory_plan(shape, lrn.rank, trainable, int(split.learner_gib * GIB), lrn.micro_batch_tokens,
                       lrn.logprob_chunk_tokens, lrn.checkpointing, rows=lrn.rows, max_rows=lrn.max_rows)
    assert plan.fits and 1 <= split.kv_sequences <= split.step_sequences
    # the KV cache reaches the step's sequences before the learner gets more than its minimum
    if split.kv_sequences < split.step_sequences:
        assert split.learner_gib < split.learner_minimum_gib + 0.05


def test_learner_minimum_is_the_plans_threshold():
    shape = model_shape(QWEN3_4B, 2)
    for learner in (_learner(), _learner(checkpointing=False), _learner(micro_batch_tokens=4096, logprob_chunk_tokens=0)):
        trainable = lora_params(shape, learner.rank, learner.targets)
        least = learner_minimum_bytes(shape, learner, trainable)
        assert least > fixed_bytes(shape, trainable, least, learner.logprob_chunk_tokens)

        def fits(budget: int) -> bool:
            return memory_plan(shape, learner.rank, trainable, budget, learner.micro_batch_tokens,
                               learner.logprob_chunk_tokens, learner.checkpointing).fits

        assert fits(least) and not fits(least - 2**20)


@pytest.mark.parametrize("gib, total, fraction", [
    (9.19, 24217 * 2**20, 9.19 * 1024 / 24217),  # RTX 4090 as CUDA reports it
    (10, 80 * GIB, 0.125),
    (24, 24 * GIB, 1.0),
])
def test_vllm_fraction_from_an_amount(gib, total, fraction):
    assert gpu_memory_fraction(gib, total) == pytest.approx(fraction)
    assert gpu_memory_fraction(gib, total) * total == pytest.approx(gib * GIB)  # what vLLM then reserves


def test_vllm_amount_above_the_device_is_refused():
    with pytest.raises(ValueError, match=r"rollout\.gpu_memory_gib=30 is more than this GPU's 23\.65 GiB"):
        gpu_memory_fraction(30, 24217 * 2**20)


@pytest.mark.parametrize("overrides, why", [
    (["rollout.num_gpus=0"], "rollout.num_gpus=0 (a CPU-only rollout)"),
    (["learner.use_gpu=false"], "learner.use_gpu=false (a CPU learner)"),
    (["rollout.engine=hf"], "rollout.engine=hf (only the vLLM engine takes a memory amount)"),
    (["rollout.replicas=2"], "rollout.replicas=2 and learner.workers=1 (one of each shares the GPU)"),
    (["rollout.num_gpus=1", "learner.gpus_per_worker=1"],
     "rollout.num_gpus=1 and learner.gpus_per_worker=1 add up to more than one GPU"),
])
def test_budget_refused_unless_one_gpu_is_shared(overrides, why):
    with pytest.raises(ConfigError) as info:
        load_config(ONE_GPU, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert f"gpu_memory_gib=22 splits ONE GPU between the rollout replica and the learner, but {why}" in message


@pytest.fixture
def qwen3_4b_dir(tmp_path: Path) -> Path:
    """A model directory holding only the config.json of Qwen3-4B (all the split reads)."""
    model = tmp_path / "Qwen3-4B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", **QWEN3_4B}))
    return model


def test_apply_writes_the_split_into_the_config(qwen3_4b_dir: Path):
    given = load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}"])
    assert given.rollout.gpu_memory_gib is None and given.learner.memory_budget_gib is None
    cfg, split = apply_memory_budget(given)
    assert (cfg.rollout.gpu_memory_gib, cfg.learner.memory_budget_gib) == (9.19, 10.98)
    assert split == split_for_run(given, QWEN3_4B, w0_on_device=False)
    # what run.json's config records; a resumed run's recorded config splits to itself
    again = type(cfg).model_validate(resolved(cfg))
    assert apply_memory_budget(again)[0] == cfg
    # no budget: nothing changes
    plain = load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "gpu_memory_gib=null"])
    assert apply_memory_budget(plain) == (plain, None)
    # a side given otherwise than the split sets it is refused, naming it
    with pytest.raises(PreflightError, match=r"^rollout\.gpu_memory_gib=5 is given with gpu_memory_gib=22, "
                                             r"which sets it \(9\.19 here\): leave it unset$"):
        apply_memory_budget(load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "rollout.gpu_memory_gib=5"]))
    with pytest.raises(PreflightError, match=r"^gpu_memory_gib=12 cannot hold Qwen3-4B twice .*needs >= 21\.1 GiB$"):
        apply_memory_budget(load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "gpu_memory_gib=12",
                                                  "share_base_weights=false"]))
    # one shared copy (share_base_weights, auto here): the learner's budget holds no weights
    with pytest.raises(PreflightError, match=r"^gpu_memory_gib=12 cannot hold Qwen3-4B once \(one shared copy of "
                                             r"7\.49 GiB weights: .*needs >= 13\.6 GiB$"):
        apply_memory_budget(load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "gpu_memory_gib=12"]))
    shared, split = apply_memory_budget(load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "gpu_memory_gib=16"]))
    assert (shared.rollout.gpu_memory_gib, shared.learner.memory_budget_gib) == (9.19, 4.98)
    assert split.minimum_gib == 13.6 and split.learner_micro_batch_tokens >= 640
    # merged LoRA's W0 on the GPU (rollout.merged_w0=device) is counted: the same budget no longer holds both
    with pytest.raises(PreflightError, match=r"^gpu_memory_gib=16 cannot hold"):
        apply_memory_budget(load_config(ONE_GPU, [f"model.name_or_path={qwen3_4b_dir}", "gpu_memory_gib=16",
                                                  "rollout.merged_w0=device"]))


def test_resume_with_the_config_file_is_not_a_change(qwen3_4b_dir: Path, tmp_path: Path):
    """run.json records the split's values; the same --config file (whose two fields are unset)
    resumes without a difference."""
    from services.receipt import Receipt
    from services.train import resume_config

    sets = [f"model.name_or_path={qwen3_4b_dir}", f"trainer.runs_dir={tmp_path / 'runs'}", "run_name=r"]
    recorded, _ = apply_memory_budget(load_config(ONE_GPU, sets))
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    Receipt(run / "run.json").start(config=resolved(recorded)).finish("completed")
    cfg, changes = resume_config(run, sets, ONE_GPU)
    assert changes == {} and cfg.rollout.gpu_memory_gib == 9.19 and cfg.learner.memory_budget_gib == 10.98
    with pytest.raises(ConfigError, match="gpu_memory_gib"):
        resume_config(run, [*sets, "gpu_memory_gib=24"], ONE_GPU)


def test_dry_run_shows_the_split_and_refuses_a_small_budget(qwen3_4b_dir: Path, tmp_path: Path):
    """Through the real CLI: --dry-run splits the budget (and refuses one that cannot hold the
    model) before anything starts or any run directory exists."""
    from cliharness import cli

    args = ["train", "--config", str(ONE_GPU), "--set", f"model.name_or_path={qwen3_4b_dir}",
            "--set", f"trainer.runs_dir={tmp_path / 'runs'}", "--dry-run"]
    done = cli(*args, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    assert shown["config"]["gpu_memory_gib"] == 22
    assert shown["config"]["rollout"]["gpu_memory_gib"] == 9.19 and shown["config"]["learner"]["memory_budget_gib"] == 10.98
    # one shared copy of the weights (share_base_weights=auto): 13.6 GiB at least, 21.1 with two
    assert shown["memory_split"]["kv_sequences"] == 8 and shown["memory_split"]["minimum_gib"] == 13.6
    done = cli(*args, "--set", "gpu_memory_gib=12", timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: gpu_memory_gib=12 cannot hold Qwen3-4B once (one shared copy of 7.49 GiB weights")
    assert lines[0].endswith("needs >= 13.6 GiB")
    done = cli(*args, "--set", "gpu_memory_gib=20", "--set", "share_base_weights=false", timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: gpu_memory_gib=20 cannot hold Qwen3-4B twice (two copies of 7.49 GiB weights")
    assert lines[0].endswith("needs >= 21.1 GiB")
    done = cli(*args, "--set", "rollout.num_gpus=0", timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "rollout.num_gpus=0 (a CPU-only rollout)" in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()


def test_the_split_needs_neither_torch_nor_ray():
    import subprocess

    code = ("import sys, services.memory_budget as m; "
            "print(sorted(x for x in ('torch', 'ray', 'vllm', 'transformers') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("tokens, row, rows, size, want", [
    (8192, 1024, 8, 8, 8192),  # configs/gpu-bench.yaml's cap over 8 rows of max_model_len
    (8192, 1000, 8, 8, 8000),  # the cap holds 8 whole rows, not 8192 tokens
    (8192, 1024, 4, 8, 4096),  # fewer rows than the cap holds
    (500, 1024, 8, 8, 1024),  # a row longer than the cap runs alone
    (None, 1024, 8, 4, 4096),  # by count
    (None, 1024, 2, 4, 2048),
])
def test_fixed_micro_batch_tokens_is_the_largest_cut_of_longest_rows(tokens, row, rows, size, want):
    from learner.microbatch import largest_micro_batch

    assert fixed_micro_batch_tokens(tokens, row, rows, size) == want
    if tokens is not None:  # what the learner's cut builds from such rows, in groups of 1, 2 or 4: never more
        assert all(largest_micro_batch([row] * rows, tokens, [i // g for i in range(rows)]) <= want for g in (1, 2, 4))
        assert largest_micro_batch([row] * rows, tokens) == want
