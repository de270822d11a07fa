"""Which row each lease gets: NeMo RL's dataloader order, as arithmetic (pure, no IO).

NeMo RL's loader gives each step `num_prompts_per_step` rows, drops the last partial batch of an
epoch (drop_last), and reshuffles every epoch. Here the k-th prompt leased from a dataset of n rows
is row order(epoch)[k mod (steps_per_epoch * P)] with epoch = k // (steps_per_epoch * P), so a
cursor is one integer and a restarted controller resumes exactly where the run left off.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache


def steps_per_epoch(rows: int, prompts_per_step: int) -> int:
    return rows // prompts_per_step


def planned_steps(max_num_steps: int, max_num_epochs: int, rows: int, prompts_per_step: int) -> int:
    """Steps the run takes: whichever of max_num_steps and the epochs ends first."""
    return min(max_num_steps, max_num_epochs * steps_per_epoch(rows, prompts_per_step))


@lru_cache(maxsize=8)
def epoch_order(rows: int, epoch: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(rows))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)


def position(k: int, rows: int, prompts_per_step: int, seed: int, shuffle: bool) -> tuple[int, int]:
    """(epoch, row index) of the k-th prompt leased (k >= 0)."""
    per_epoch = steps_per_epoch(rows, prompts_per_step) * prompts_per_step
    epoch, offset = divmod(k, per_epoch)
    return epoch, epoch_order(rows, epoch, seed, shuffle)[offset]


def holdout(rows: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) row indices: a seeded shuffle, then ceil(fraction * rows) held out."""
    if fraction <= 0:
        return list(range(rows)), []
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    held = math.ceil(fraction * rows)
    return sorted(order[held:]), sorted(order[:held])
