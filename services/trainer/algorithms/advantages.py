"""GRPO advantages: a per-group baseline, optionally divided by the group's reward std.

This owns NeMo RL's `GRPOAdvantageEstimator` and `calculate_baseline_and_std_per_prompt`
semantics (reference/nemo_rl.md §4.2), keyed by prompt id instead of prompt token rows.

For sample i of a group, S_i is the set its baseline is taken over: the group's valid
samples (mean baseline) or the group's valid samples other than i (leave-one-out).

    baseline_i = mean(S_i)
    std_i      = Bessel-corrected std of S_i; 0 when |S_i| <= 1 or S_i is constant
    A_i        = r_i - baseline_i, then A_i / (std_i + 1e-6) where std_i > 0 (normalize_rewards)
    A_i        = clamp(A_i, advantage_clip_low, advantage_clip_high)

A group with at most one valid sample gives all its samples 0, and invalid samples get 0.
A constant set has baseline equal to its value and std exactly 0, so binary rewards
never divide a real difference by a rounding-error std.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

STD_EPSILON = 1e-6
"""Added to the std before dividing, as NeMo RL does."""


def group_layout(prompt_ids: Sequence[str]) -> tuple[Tensor, Tensor, int, int]:
    """Group index and slot within the group of each sample, in first-seen order.

    Returns (group [B] long, slot [B] long, number of groups G, largest group size N).
    Samples of one group need not be contiguous.
    """
    index_of: dict[str, int] = {}
    sizes: list[int] = []
    group, slot = [], []
    for pid in prompt_ids:
        g = index_of.setdefault(pid, len(index_of))
        if g == len(sizes):
            sizes.append(0)
        group.append(g)
        slot.append(sizes[g])
        sizes[g] += 1
    as_long = dict(dtype=torch.long)
    return torch.tensor(group, **as_long), torch.tensor(slot, **as_long), len(sizes), max(sizes, default=0)


def _baseline_and_std(rewards: Tensor, members: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and Bessel std of each sample's baseline set.

    rewards: [G, N] padded rewards; members: [G, N, N] bool, members[g, i, j] when j is in S_i.
    Returns baseline [G, N] and std [G, N].
    """
    others = rewards[:, None, :].expand_as(members)
    count = members.sum(-1)
    mean = others.masked_fill(~members, 0).sum(-1) / count.clamp(min=1)
    low = others.masked_fill(~members, torch.inf).amin(-1)
    high = others.masked_fill(~members, -torch.inf).amax(-1)
    constant = (low == high) | (count <= 1)
    mean = torch.where(low == high, high, mean)
    squares = (others - mean[..., None]).masked_fill(~members, 0).square().sum(-1)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return mean, torch.where(constant, torch.zeros_like(std), std)


def compute_advantages(
    rewards: Tensor,
    prompt_ids: Sequence[str],
    valid: Tensor,
    *,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    advantage_clip_low: float | None = None,
    advantage_clip_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-sample GRPO advantages.

    rewards: [B] float, one scalar reward per completion (invalid entries may hold anything).
    prompt_ids: B ids; equal ids form a group.
    valid: [B] bool, samples that count for the baseline and get an advantage.
    Returns advantages [B] (rewards' dtype) and metrics over the valid samples.
    """
    if rewards.dim() != 1 or len(prompt_ids) != rewards.shape[0] or valid.shape != rewards.shape:
        raise ValueError("rewards, prompt_ids and valid must all have length B")
    group, slot, num_groups, size = group_layout(prompt_ids)
    group, slot, valid = group.to(rewards.device), slot.to(rewards.device), valid.bool()
    padded = rewards.new_zeros(num_groups, size)
    padded[group, slot] = torch.where(valid, rewards, torch.zeros_like(rewards))
    is_valid = torch.zeros(num_groups, size, dtype=torch.bool, device=rewards.device)
    is_valid[group, slot] = valid

    members = is_valid[:, None, :].expand(num_groups, size, size)
    if use_leave_one_out_baseline:
        members = members & ~torch.eye(size, dtype=torch.bool, device=rewards.device)
    baseline, std = _baseline_and_std(padded, members)
    advantages = padded - baseline
    if normalize_rewards:
        advantages = torch.where(std > 0, advantages / (std + STD_EPSILON), advantages)
    if advantage_clip_low is not None or advantage_clip_high is not None:
        advantages = advantages.clamp(min=advantage_clip_low, max=advantage_clip_high)
    keep = is_valid & (is_valid.sum(-1, keepdim=True) > 1)
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))
    out = advantages[group, slot]
    return out, _metrics(out[valid], padded, is_valid)


def _metrics(advantages: Tensor, padded: Tensor, is_valid: Tensor) -> dict[str, float]:
    """Advantage summary over valid samples, and the share of groups with no reward spread.

    A group counts as zero-variance when all its valid rewards are equal (one valid
    sample included); groups without a valid sample are not counted.
    """
    present = is_valid.any(-1)
    low = padded.masked_fill(~is_valid, torch.inf).amin(-1)
    high = padded.masked_fill(~is_valid, -torch.inf).amax(-1)
    flat = (low == high) & present
    empty = advantages.numel() == 0
    return {
        "advantages/mean": 0.0 if empty else advantages.mean().item(),
        "advantages/std": 0.0 if empty else advantages.std(correction=0).item(),
        "advantages/min": 0.0 if empty else advantages.min().item(),
        "advantages/max": 0.0 if empty else advantages.max().item(),
        "advantages/zero_variance_group_fraction": flat.sum().item() / max(int(present.sum()), 1),
    }
