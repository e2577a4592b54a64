"""learner.strategy=ddp over 2 real gloo ranks (tests/fsdp_ranks.py ``uneven``) whose shards cut
into 2 and 1 micro-batches: the step finishes (a timeout fails it instead of hanging) and is the
step of 1 rank on the whole batch.

Without padding, DDP's per-forward buffer broadcast and per-backward bucket all-reduce leave
the rank with more micro-batches waiting in collectives the other never joins (or pair them
with the wrong ones). The ranks agree on the most micro-batches (one all-reduce MAX) and the
rank with fewer runs a zero-loss padding one (learner/passes.py ``pad_micro_batches``), in
old_log_prob, ref and both update epochs.

Gradients and adapter are compared bit for bit: one row per micro-batch, so each row's forward
is the 1-rank run's; rank 0 accumulates g1 + g2 locally, rank 1 g3 (plus the padding's exact
zeros) and the all-reduce sums the two, the 1-rank run's (g1 + g2) + g3; the loss's dp_size
factor 2 and DDP's mean over 2 are exact. That needs DDP to all-reduce once per update pass,
under no_sync for the forward AND backward of all but the last micro-batch (an all-reduce per
micro-batch sums in another order). The metrics are sums reduced over ranks, to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_ranks import uneven_batch, uneven_config
from learner.passes import make_micro_batches
from learner.types import shard_bounds
from test_learner_fsdp import rel, run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_uneven")
    return {name: run_ranks("ddp", world, root / name, mode=("uneven",), timeout=120) | {"out": root / name}
            for name, world in (("ddp1", 1), ("ddp2", 2))}


def test_the_ranks_cut_the_batch_into_2_and_1_micro_batches():
    batch, cfg = uneven_batch(), uneven_config("ddp", 2).learner
    counts = [len(make_micro_batches(batch.rows(*shard_bounds(len(batch), 2, r)), cfg.micro_batch_size))
              for r in range(2)]
    assert counts == [2, 1]
    assert cfg.beta > 0 and cfg.epochs_per_step == 2  # old_log_prob and ref run, two update passes


def test_ddp_ranks_with_unequal_micro_batch_counts_take_the_step_of_one_rank(uneven):
    got, want = uneven["ddp2"], uneven["ddp1"]
    # both ranks ran 2 epochs of 2 backwards, the second of each the pass's last (rank 1's a padding one)
    for rank in range(2):
        assert torch.load(got["out"] / f"backwards_rank{rank}.pt") == [False, True, False, True], rank
    assert torch.load(want["out"] / "backwards_rank0.pt") == [False, False, True, False, False, True]
    assert set(got["grads"]) == set(want["grads"])
    for name, g in want["grads"].items():
        assert torch.equal(got["grads"][name], g), name
    for name, w in want["step1"].items():
        assert torch.equal(got["step1"][name], w), name
    assert rel(got["grads"], want["grads"]) == 0.0
    assert any(v.abs().sum() > 0 for k, v in got["grads"].items() if "lora_B" in k)  # it did train
    assert got["metrics"]["grad_norm"] == want["metrics"]["grad_norm"]
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-6)
    for key in ("kl", "entropy", "clip_frac", "ratio", "ppl_ratio", "rollout_kl", "pg_loss"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6, abs=1e-9), key
    assert got["metrics"]["sequences"] == want["metrics"]["sequences"] == 3.0
    assert got["metrics"]["response_tokens"] == want["metrics"]["response_tokens"] == 16.0
    assert want["metrics"]["kl"] > 0  # the ref pass ran: beta > 0 on an adapter that moved


def test_ddp_all_reduces_once_per_update_pass_not_per_micro_batch(tmp_path):
    """ddp_grad_sync's no_sync covers each micro-batch's forward as well as its backward (the
    ``micro_batch`` context): with it round the backward only, DDP's forward has already armed
    the reducer and every backward all-reduced. Counted by a comm hook on DDP over a 1-rank gloo
    group: a pass of 3 micro-batches all-reduces what a pass of 1 does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from learner.losses import LossNorm, ObjectiveParams
    from learner.passes import ddp_grad_sync, update_actor
    from learner.policy import PolicyLearner
    from test_learner_fsdp import free_port

    cfg = uneven_config("ddp", 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        learner = PolicyLearner.for_run(cfg, rank=0, world_size=1)
        ddp = DistributedDataParallel(learner.lm)
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        sync = ddp_grad_sync(ddp, learner.optimizer, cfg.learner.max_grad_norm)
        batch = uneven_batch()
        norm = LossNorm(loss_type=cfg.learner.loss_type, global_tokens=float(batch.num_response_tokens()),
                        global_sequences=len(batch), local_tokens=float(batch.num_response_tokens()),
                        max_completion_length=4, dp_size=1)
        mbs = make_micro_batches(batch, 1)
        per_pass = []
        for cut in (mbs, mbs[:1], mbs):
            calls.clear()
            update_actor(ddp, cut, sync, norm, ObjectiveParams.from_config(cfg.learner.model_copy(update={"beta": 0.0})),
                         temperature=1.0, epochs=1,
                         old=None, ref=None, entropy_bonus=False)
            per_pass.append(sorted(calls))
        assert len(mbs) == 3 and per_pass[0], per_pass
        assert per_pass[0] == per_pass[1] == per_pass[2]  # every bucket once per pass
        assert sorted(set(per_pass[0])) == per_pass[0]
    finally:
        dist.destroy_process_group()
