"""One rank of a real gloo process group running a PolicyLearner, for tests/test_learner_fsdp.py.

    python tests/fsdp_ranks.py STRATEGY WORLD RANK PORT OUT_DIR [RESUME_FROM]
    python tests/fsdp_ranks.py uneven STRATEGY WORLD RANK PORT OUT_DIR
    python tests/fsdp_ranks.py packed on|off STRATEGY WORLD RANK PORT OUT_DIR
    python tests/fsdp_ranks.py compiled on|off STRATEGY WORLD RANK PORT OUT_DIR

Each rank builds the learner (learner.strategy=STRATEGY over WORLD gloo ranks on the CPU), takes
one step on batch 0, saves a checkpoint, takes a second step on batch 1; then a second learner
resumed from that checkpoint (or from RESUME_FROM, a checkpoint another run wrote) takes the
same second step (and, given RESUME_FROM, a third learner resumed from it). Every rank joins every gather; rank 0 writes what it saw to OUT_DIR/result.pt:
the initial and updated adapters (full tensors), the LoRA gradients of step 1 (before clipping
and the optimizer step), the losses, the published payload's bytes, the base weights as loaded
(full), and the files of the checkpoint.

``uneven``: one step on a batch of 3 rows (``uneven_batch``) that 2 ranks cut into 2 and 1
micro-batches, with every pass a collective under fsdp2 and every update forward/backward one
under DDP (old_log_prob not folded, ref with beta > 0, two update epochs); rank 0 writes its
metrics, the LoRA gradients of the last epoch, the adapter before and after the step and the
learner's stats; every rank writes OUT_DIR/backwards_rank{RANK}.pt, the ``last`` flag of each
backward it ran.

``packed``: the same, with learner.pack_sequences on or off, two rows per micro-batch, on
``packed_batch`` (tests/test_learner_pack.py).

``compiled``: the uneven run with learner.compile_layers on or off (tests/test_learner_compile.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import RunConfig  # noqa: E402
from learner.checkpoint import checkpoint_dir  # noqa: E402
from learner.policy import PolicyLearner  # noqa: E402
from learner.types import TrainBatch  # noqa: E402
from learner.worker import save_answer, step_answer  # noqa: E402
from learner.protocol import Save  # noqa: E402


def run_config(strategy: str, workers: int) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 5, "model": {"name_or_path": "tiny-random"},
        "learner": {"strategy": strategy, "workers": workers, "lr": 1e-3, "micro_batch_size": 2,
                    "lora": {"r": 4, "alpha": 8},
                    # off for every strategy, so the runs compare strategies only (fsdp2 cannot share it;
                    # the shared prefix has its own equivalence test, tests/test_shared_prefix.py)
                    "share_prompt_prefix": False},
        "rollout": {"max_tokens": 4}, "trainer": {"steps": 10},
    })


def batch(k: int) -> TrainBatch:
    """Six rows in three groups of two sharing a prompt (the shared-prefix path runs too)."""
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(1, 400, (3 + i % 2,), generator=g).tolist() for i in range(3)]
    responses = [torch.randint(1, 400, (2 + i % 3,), generator=g).tolist() for i in range(6)]
    return TrainBatch([prompts[i // 2] for i in range(6)], responses, [[-10.8] * len(r) for r in responses],
                      advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


def uneven_config(strategy: str, workers: int) -> RunConfig:
    """One row per micro-batch: over 2 ranks, rank 0 has 2 micro-batches and rank 1 one."""
    cfg = run_config(strategy, workers).model_dump()
    cfg["learner"].update(micro_batch_size=1, micro_batch_tokens=None, beta=0.05, epochs_per_step=2, entropy_coef=0.01)
    return RunConfig.model_validate(cfg)


def uneven_batch() -> TrainBatch:
    """Three rows of different lengths (one group of two, one single row)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (3, 6)]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (2, 5, 9)]
    return TrainBatch([prompts[0], prompts[0], prompts[1]], responses,
                      [[-10.8 + 0.1 * i for i in range(len(r))] for r in responses], advantages=[1.0, -1.0, 0.5])


def packed_config(strategy: str, workers: int, pack: bool) -> RunConfig:
    """``uneven_config`` with two rows per micro-batch, packed into one row or padded."""
    cfg = uneven_config(strategy, workers).model_dump()
    cfg["learner"].update(micro_batch_size=2, pack_sequences=pack, logprob_chunk_tokens=8)
    return RunConfig.model_validate(cfg)


def packed_batch() -> TrainBatch:
    """Five rows of very different lengths in two groups: over 2 ranks rank 0 runs micro-batches
    of 2 and 1 rows, rank 1 one of 2 rows and a padding micro-batch (unpacked)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (4, 7)]
    responses = [torch.randint(1, 400, (n,), generator=g).tolist() for n in (2, 17, 5, 3, 21)]
    return TrainBatch([prompts[0]] * 3 + [prompts[1]] * 2, responses,
                      [[-10.8 + 0.1 * i for i in range(len(r))] for r in responses],
                      advantages=[1.0, -1.0, 0.5, -0.5, 2.0], group_ids=[0, 0, 0, 1, 1])


def compiled_config(strategy: str, workers: int, compiled: bool) -> RunConfig:
    """``uneven_config`` with the decoder layers compiled or eager."""
    cfg = uneven_config(strategy, workers).model_dump()
    cfg["learner"].update(compile_layers=compiled)
    return RunConfig.model_validate(cfg)


def main_uneven(strategy: str, world: int, rank: int, port: int, out: Path, pack: bool | None = None,
                compiled: bool | None = None) -> None:
    """``pack`` and ``compiled`` None: the uneven run; ``pack`` True/False: ``packed_config``'s on
    ``packed_batch``; ``compiled`` True/False: ``compiled_config``'s."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if pack is not None:
        cfg = packed_config(strategy, world, pack)
    elif compiled is not None:
        import torch._dynamo as dynamo

        dynamo.config.disable = False  # TORCH_COMPILE_DISABLE may come with the environment
        cfg = compiled_config(strategy, world, compiled)
    else:
        cfg = uneven_config(strategy, world)
    learner = PolicyLearner.for_run(cfg, rank=rank, world_size=world)
    init = adapter(learner)  # every rank: the gather is collective
    grads: dict = {}
    capture_grads(learner, grads)
    lasts = record_backwards(learner)
    metrics, _ = learner.step(uneven_batch() if pack is None else packed_batch())
    torch.save(lasts, out / f"backwards_rank{rank}.pt")
    result = {"metrics": metrics, "grads": grads, "init": init, "step1": adapter(learner), "stats": learner.stats()}
    if compiled is not None:  # what dynamo made of the layers: graphs, and where it broke them
        from torch._dynamo.utils import counters

        result |= {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"])}
    if rank == 0:
        torch.save(result, out / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def adapter(learner: PolicyLearner) -> dict[str, torch.Tensor]:
    from learner.lora import adapter_state_dict

    gathered = learner.full_adapter()
    state = gathered if gathered is not None else adapter_state_dict(learner.peft_model)
    return {k: v.clone() for k, v in state.items()}  # a snapshot, not a view of the live parameters


def capture_grads(learner: PolicyLearner, into: dict) -> None:
    """The LoRA gradients as the optimizer step is about to see them (full tensors)."""
    sync = learner.grad_sync
    names = {id(p): n for n, p in learner.peft_model.named_parameters() if p.requires_grad}

    def step() -> float:
        for p in (p for g in learner.optimizer.param_groups for p in g["params"]):
            into[names[id(p)]] = full(p.grad)
        return sync.step()

    learner.grad_sync = replace(sync, step=step)  # keeps the rest of how it syncs


def record_backwards(learner: PolicyLearner) -> list[bool]:
    """The ``last`` flag of every backward the update runs on this rank, in order."""
    sync, lasts = learner.grad_sync, []

    def backward(loss: torch.Tensor, last: bool) -> None:
        lasts.append(last)
        sync.backward(loss, last)

    learner.grad_sync = replace(sync, backward=backward)
    return lasts


def main(strategy: str, world: int, rank: int, port: int, out: Path, resume_from: Path | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = run_config(strategy, world)
    result: dict = {}
    learner = PolicyLearner.for_run(cfg, rank=rank, world_size=world)
    result["base"] = {n: full(p) for n, p in learner.peft_model.named_parameters() if not p.requires_grad}
    result["buffers"] = {n: b.clone() for n, b in learner.peft_model.named_buffers()}
    result["init"] = adapter(learner)
    grads: dict = {}
    capture_grads(learner, grads)
    answer = step_answer(learner, batch(0), lambda payload: payload)  # every rank: the gather is collective
    result["grads"] = grads
    result["step1"] = adapter(learner)
    if rank == 0:
        result["loss1"] = answer.metrics["loss"]
        result["grad_norm1"] = answer.metrics["grad_norm"]
        result["payload1"] = bytes(answer.adapter.safetensors.tobytes())
    saved = save_answer(learner, Save(step=1, data_position=None), out / "run")
    ckpt = checkpoint_dir(out / "run", 1)
    if rank == 0:
        result["adapter_sha"] = saved.adapter_sha256
        result["ckpt_files"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
        result["ckpt_adapter"] = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
        result["ckpt_optimizer"] = torch.load(ckpt / "optimizer.pt", weights_only=False)
    result["loss2"] = learner.step(batch(1))[0]["loss"]
    result["step2"] = adapter(learner)
    dist.barrier()

    resumed = PolicyLearner.for_run(cfg, rank=rank, world_size=world, resume_from=ckpt)
    result["resumed_step"] = resumed.step_count
    result["resumed_loss2"] = resumed.step(batch(1))[0]["loss"]
    result["resumed2"] = adapter(resumed)
    if resume_from is not None:  # another run's checkpoint (another strategy or world size)
        other = PolicyLearner.for_run(cfg, rank=rank, world_size=world, resume_from=resume_from)
        other.step(batch(1))
        result["other_resumed2"] = adapter(other)
    if rank == 0:
        torch.save(result, out / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1] == "uneven":
    strategy_, world_, rank_, port_, out_ = sys.argv[2:7]
    main_uneven(strategy_, int(world_), int(rank_), int(port_), Path(out_))
elif __name__ == "__main__" and sys.argv[1] == "packed":
    pack_, strategy_, world_, rank_, port_, out_ = sys.argv[2:8]
    main_uneven(strategy_, int(world_), int(rank_), int(port_), Path(out_), pack=pack_ == "on")
elif __name__ == "__main__" and sys.argv[1] == "compiled":
    on_, strategy_, world_, rank_, port_, out_ = sys.argv[2:8]
    main_uneven(strategy_, int(world_), int(rank_), int(port_), Path(out_), compiled=on_ == "on")
elif __name__ == "__main__":
    strategy_, world_, rank_, port_, out_ = sys.argv[1:6]
    main(strategy_, int(world_), int(rank_), int(port_), Path(out_),
         Path(sys.argv[6]) if len(sys.argv) > 6 else None)
