"""DAPO helpers: which groups dynamic sampling drops, and the overlong reward penalty.

Dynamic sampling (grpo.use_dynamic_sampling) keeps only groups whose rewards differ: a group
with equal rewards has zero advantage everywhere and no gradient. The controller drops the
groups `zero_variance_groups` names and leases more prompts to refill the step.

Overlong shaping (grpo.reward_shaping) is NeMo RL's `apply_reward_shaping` DAPO branch:
with expected = max_response_length - overlong_buffer_length,

    penalty = min(-(length - expected) / overlong_buffer_length * overlong_buffer_penalty, 0)

so it ramps linearly from 0 at `expected` to -overlong_buffer_penalty at max_response_length,
and keeps growing past it, exactly as NeMo RL (no floor). The penalty is added to the reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from services.common.config import RewardShapingConfig
from services.trainer.algorithms.advantages import group_layout


def zero_variance_groups(rewards: Tensor, prompt_ids: Sequence[str]) -> set[str]:
    """Ids of the groups whose rewards are all equal (a one-sample group included).

    rewards: [B] float; prompt_ids: B ids, equal ids form a group.
    """
    if rewards.dim() != 1 or len(prompt_ids) != rewards.shape[0]:
        raise ValueError("rewards and prompt_ids must both have length B")
    group, _, num_groups, _ = group_layout(prompt_ids)
    group = group.to(rewards.device)
    low = rewards.new_full((num_groups,), torch.inf).scatter_reduce(0, group, rewards, "amin")
    high = rewards.new_full((num_groups,), -torch.inf).scatter_reduce(0, group, rewards, "amax")
    first_id = dict.fromkeys(prompt_ids)  # insertion order = group index order
    flat = (low == high).tolist()
    return {pid for pid, is_flat in zip(first_id, flat, strict=True) if is_flat}


def overlong_reward_penalty(response_lengths: Tensor, cfg: RewardShapingConfig) -> Tensor:
    """Penalty (<= 0) to add to each reward: [B] float32 from response lengths [B] in tokens.

    All zeros when shaping is disabled.
    """
    if not cfg.enabled:
        return torch.zeros(response_lengths.shape, dtype=torch.float32, device=response_lengths.device)
    if cfg.overlong_buffer_length == 0:
        raise ValueError("reward_shaping.overlong_buffer_length must be > 0 when shaping is enabled")
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    exceed = response_lengths.to(torch.float64) - expected
    penalty = -exceed / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty
    return torch.where(penalty < 0, penalty, torch.zeros_like(penalty)).to(torch.float32)
