"""Which rows each rank runs in each optimizer step and micro-batch (pure, no IO).

Every rank holds the whole step's batch, so every rank can compute every rank's plan.
That matters because FSDP forward and backward passes are collectives: all ranks must run
the same NUMBER of micro-batches, so a rank with fewer rows gets empty ones to match.

    rows 0..B-1 ─▶ optimizer steps of train_global_batch_size consecutive rows
                ─▶ rank r takes rows r, r + world, ... of each
                ─▶ micro-batches: train_micro_batch_size rows, or as many rows as fit a
                   token budget (dynamic batching and sequence packing)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MicroBatches = list[list[int]]


def split_by_count(rows: Sequence[int], size: int) -> MicroBatches:
    return [list(rows[i:i + size]) for i in range(0, len(rows), size)]


def split_by_tokens(rows: Sequence[int], lengths: Sequence[int], budget: int) -> MicroBatches:
    """Greedy, in order: a micro-batch takes rows while their total length fits `budget`.

    A row longer than the budget goes alone (it cannot be cut: the loss needs it whole).
    """
    out: MicroBatches = []
    used = budget + 1
    for row in rows:
        if used + lengths[row] > budget:
            out.append([])
            used = 0
        out[-1].append(row)
        used += lengths[row]
    return out


def _split(rows: Sequence[int], lengths: Sequence[int], size: int, budget: int | None) -> MicroBatches:
    return split_by_tokens(rows, lengths, budget) if budget else split_by_count(rows, size)


def lockstep(per_rank: list[MicroBatches], rank: int) -> MicroBatches:
    """This rank's micro-batches, padded with empty ones to the most any rank has."""
    count = max(len(p) for p in per_rank)
    return per_rank[rank] + [[] for _ in range(count - len(per_rank[rank]))]


def optimizer_steps(n: int, global_batch: int | None) -> list[range]:
    """Consecutive row ranges, one per optimizer step (the last may be shorter)."""
    size = global_batch or n
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def train_plan(lengths: Sequence[int], rank: int, world: int, *, global_batch: int | None, micro: int,
               budget: int | None = None) -> list[MicroBatches]:
    """[optimizer step][micro-batch] -> this rank's row indices (possibly empty)."""
    plan = []
    for chunk in optimizer_steps(len(lengths), global_batch):
        per_rank = [_split(list(chunk)[r::world], lengths, micro, budget) for r in range(world)]
        plan.append(lockstep(per_rank, rank))
    return plan


def rank_rows(n: int, rank: int, world: int, global_batch: int | None) -> list[int]:
    """Every row this rank trains on in the step, in plan order."""
    return [row for chunk in optimizer_steps(n, global_batch) for row in list(chunk)[rank::world]]


def logprob_plan(lengths: Sequence[int], rank: int, world: int, *, global_batch: int | None, micro: int,
                 budget: int | None = None) -> MicroBatches:
    """Micro-batches for recomputing logprobs of exactly the rows this rank will train on."""
    per_rank = [_split(rank_rows(len(lengths), r, world, global_batch), lengths, micro, budget)
                for r in range(world)]
    return lockstep(per_rank, rank)


def padded_width(lengths: Sequence[int], multiple: int = 1) -> int:
    """Width a padded micro-batch needs: its longest row, rounded up to `multiple`."""
    return multiple * math.ceil(max(lengths, default=1) / multiple)
