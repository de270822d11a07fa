"""Reward transforms that the trainer and replay must apply alike: pure Python, no torch."""

from __future__ import annotations

from services.common.config import RewardScalingConfig


def scale_reward(reward: float, cfg: RewardScalingConfig) -> float:
    """NeMo RL's grpo.reward_scaling: clamp to [source_min, source_max], then map that range linearly onto
    [target_min, target_max]. The reward itself when scaling is disabled."""
    if not cfg.enabled:
        return reward
    clamped = min(max(reward, cfg.source_min), cfg.source_max)
    return cfg.target_min + (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min) * (
        cfg.target_max - cfg.target_min)
