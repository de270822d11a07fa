"""DAPO's overlong reward penalty. (Dynamic sampling's check is replay's: services/replay/validate.py.)

Overlong shaping (grpo.reward_shaping) is NeMo RL's `apply_reward_shaping` DAPO branch:
with expected = max_response_length - overlong_buffer_length,

    penalty = min(-(length - expected) / overlong_buffer_length * overlong_buffer_penalty, 0)

so it ramps linearly from 0 at `expected` to -overlong_buffer_penalty at max_response_length,
and keeps growing past it, exactly as NeMo RL (no floor). The penalty is added to the reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.common.config import RewardShapingConfig


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
