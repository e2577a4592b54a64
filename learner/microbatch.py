"""How a worker's shard is cut into micro-batches, and what a step's learner work costs.

Micro-batches by token budget (``learner.micro_batch_tokens``): a fixed count of sequences
either wastes the GPU on short completions or runs out of memory on long ones. The cost of a
micro-batch is its padded size, rows x longest row (what the forward allocates), or, with
``packed`` (learner.pack_sequences: the rows concatenated into one row, no padding), the sum of
its rows' lengths; consecutive rows are taken while that stays within the budget. A GRPO group
is kept whole where it fits,
so its rows share their prompt (learner.shared_prefix); a group too big for the budget is cut
by rows; a single row longer than the budget goes alone (never dropped). The loss is the same
for any cut: losses.py normalises by the GLOBAL token and sequence counts, so micro-batch
losses add up to the one-batch loss (tests/test_learner_gpu_opts.py checks the gradients).

Model FLOPs and MFU: the usual dense-transformer count, 2 x params per token for a forward,
6 x params per token for forward + backward (attention's quadratic term left out). With LoRA
the frozen weights get no weight gradients, so the real work of a training token is nearer
4 x params: MFU by this convention states the work a full fine-tune of the same tokens would
do, which is how TRL, verl and most papers report it. The peak is the device's dense bf16 rate
(``learner.peak_flops``; ~989 TFLOP/s for an H100/H200 SXM by the datasheet).

Plain functions, no torch: unit-tested on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence


def _runs(groups: Sequence[int], n: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive equal group ids (one run per row without groups)."""
    if not groups:
        return [(i, i + 1) for i in range(n)]
    if len(groups) != n:
        raise ValueError(f"{len(groups)} group ids for {n} rows")
    out, lo = [], 0
    for i in range(1, n + 1):
        if i == n or groups[i] != groups[lo]:
            out.append((lo, i))
            lo = i
    return out


def micro_batch_cost(lengths: Sequence[int], packed: bool = False) -> int:
    """Tokens a micro-batch of rows of these lengths allocates: rows x longest (right-padded),
    or the sum of the lengths (``packed``: one row, no padding)."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def token_budget_bounds(lengths: Sequence[int], budget: int, groups: Sequence[int] = (),
                        packed: bool = False) -> list[tuple[int, int]]:
    """[lo, hi) row ranges covering every row in order, each costing (``micro_batch_cost``) at
    most ``budget`` unless it is a single row. Whole groups (runs of equal ``groups`` ids) stay in
    one micro-batch where they fit; a group that does not fit is split by rows."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    n = len(lengths)
    atoms: list[tuple[int, int]] = []
    for lo, hi in _runs(groups, n):
        if micro_batch_cost(lengths[lo:hi], packed) <= budget:
            atoms.append((lo, hi))
        else:
            atoms.extend((i, i + 1) for i in range(lo, hi))
    out: list[tuple[int, int]] = []
    cur: tuple[int, int, int, int] | None = None  # lo, hi, longest, sum of lengths
    for lo, hi in atoms:
        longest, total = max(lengths[lo:hi]), sum(lengths[lo:hi])
        if cur is not None:
            merged = (cur[0], hi, max(cur[2], longest), cur[3] + total)
            if (merged[3] if packed else (hi - cur[0]) * merged[2]) <= budget:
                cur = merged
                continue
            out.append((cur[0], cur[1]))
        cur = (lo, hi, longest, total)
    if cur is not None:
        out.append((cur[0], cur[1]))
    return out


def largest_micro_batch(lengths: Sequence[int], budget: int, groups: Sequence[int] = (),
                        packed: bool = False) -> int:
    """The cost (``micro_batch_cost``) of the largest micro-batch ``token_budget_bounds`` cuts
    these rows into: what a forward over them holds at most, which a group-whole cut keeps below
    the budget wherever the next whole group would not fit (0 for no rows)."""
    return max((micro_batch_cost(lengths[lo:hi], packed) for lo, hi in
                token_budget_bounds(lengths, budget, groups, packed)), default=0)


def count_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of ``size`` consecutive rows (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {size}")
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def capped_count_bounds(lengths: Sequence[int], size: int, budget: int,
                        groups: Sequence[int] = (), packed: bool = False) -> list[tuple[int, int]]:
    """``count_bounds`` (``size`` rows each), except that a micro-batch whose cost
    (``micro_batch_cost``) exceeds ``budget`` tokens is cut further by ``token_budget_bounds``
    (groups whole where they fit). With a budget that every count micro-batch fits, exactly ``count_bounds``: the cut of
    ``learner.micro_batch_tokens=auto`` when the memory allows micro_batch_size rows."""
    if groups and len(groups) != len(lengths):
        raise ValueError(f"{len(groups)} group ids for {len(lengths)} rows")
    out: list[tuple[int, int]] = []
    for lo, hi in count_bounds(len(lengths), size):
        if micro_batch_cost(lengths[lo:hi], packed) <= budget:
            out.append((lo, hi))
            continue
        sub = token_budget_bounds(lengths[lo:hi], budget, groups[lo:hi] if groups else (), packed)
        out.extend((lo + a, lo + b) for a, b in sub)
    return out


def computed_tokens(lengths: Sequence[int], shared_prefix: int) -> int:
    """Tokens one forward of a micro-batch actually runs (padding excluded): a shared prefix of
    c tokens once, then each row's remaining tokens."""
    if not lengths:
        return 0
    c = shared_prefix if len(lengths) > 1 else 0
    return c + sum(length - c for length in lengths)


def model_flops(params: int, train_tokens: int, forward_tokens: int = 0) -> float:
    """6 * params per token trained (forward + backward), 2 * params per forward-only token."""
    return 6.0 * params * train_tokens + 2.0 * params * forward_tokens


def mfu(flops: float, seconds: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of ``devices`` devices."""
    if seconds <= 0 or peak_flops <= 0 or devices < 1:
        return 0.0
    return flops / seconds / (peak_flops * devices)
