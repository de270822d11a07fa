"""Advantages: GRPO's per-group baseline and std, and Reinforce++'s batch whitening.

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

Reinforce++ (NeMo RL's `ReinforcePlusPlusAdvantageEstimator`, used by ProRL v2) keeps the
group mean but replaces the group std by one whitening over the whole step's loss tokens;
see `reinforce_plus_plus_advantages`. GDPO (`GDPOAdvantageEstimator`) takes GRPO's advantage of
each reward component, sums them with weights and standardises the sum over the batch; see
`gdpo_advantages`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

STD_EPSILON = 1e-6
"""Added to the std before dividing, as NeMo RL does."""
WHITENING_VAR_FLOOR = 1e-8
"""Reinforce++ divides by sqrt(max(var, this)), as NeMo RL does."""


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


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    prompt_ids: Sequence[str],
    loss_tokens: Tensor,
    *,
    minus_baseline: bool,
    advantage_clip_low: float | None = None,
    advantage_clip_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-sample Reinforce++ advantages.

    rewards: [B] float; prompt_ids: B ids, equal ids form a group.
    loss_tokens: [B], the number of tokens sample i trains on (0 for a sample out of the loss).

        A_i = r_i - mean of r over i's group (every sample of it)   if minus_baseline, else r_i
        mu  = sum_i n_i A_i / sum_i n_i,  var = sum_i n_i (A_i - mu)^2 / sum_i n_i
        A_i = (A_i - mu) / sqrt(max(var, WHITENING_VAR_FLOOR)), then clamped as GRPO's

    NeMo RL gives every loss token of a sample its advantage and whitens over the loss tokens,
    so a sample weighs once per token it trains on (n_i). A batch with no loss token gets zeros.
    Returns advantages [B] (rewards' dtype) and the same metrics as `compute_advantages`.
    """
    if rewards.dim() != 1 or len(prompt_ids) != rewards.shape[0] or loss_tokens.shape != rewards.shape:
        raise ValueError("rewards, prompt_ids and loss_tokens must all have length B")
    group, _, num_groups, _ = group_layout(prompt_ids)
    group = group.to(rewards.device)
    advantages = rewards
    if minus_baseline:
        sums = rewards.new_zeros(num_groups).index_add_(0, group, rewards)
        counts = rewards.new_zeros(num_groups).index_add_(0, group, torch.ones_like(rewards))
        advantages = rewards - (sums / counts)[group]
    weight = loss_tokens.to(rewards.dtype)
    total = weight.sum()
    if total > 0:
        mean = (weight * advantages).sum() / total
        var = (weight * (advantages - mean).square()).sum() / total
        advantages = (advantages - mean) * var.clamp(min=WHITENING_VAR_FLOOR).rsqrt()
    else:
        advantages = torch.zeros_like(rewards)
    if advantage_clip_low is not None or advantage_clip_high is not None:
        advantages = advantages.clamp(min=advantage_clip_low, max=advantage_clip_high)
    return advantages, _metrics_all_valid(advantages, rewards, prompt_ids)


def gdpo_advantages(
    components: Tensor,
    prompt_ids: Sequence[str],
    *,
    weights: Sequence[float] | None,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    advantage_clip_low: float | None = None,
    advantage_clip_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-sample GDPO advantages (arXiv 2601.05242).

    components: [B, K] float, reward component k of sample i (K >= 2, in the order `weights` follow).

        A_k = GRPO's advantage of component k (group baseline, optionally leave-one-out; / group std)
        A   = sum_k w_k A_k                                   (w = 1 for every k when `weights` is None)
        A   = (A - mean(A)) / std(A)  over the batch, Bessel std; A - mean(A) when std is 0; then clamped

    Returns advantages [B] (components' dtype) and the metrics of `compute_advantages`, over the summed reward.
    """
    if components.dim() != 2 or components.shape[1] < 2:
        raise ValueError(f"GDPO needs [B, K >= 2] reward components, got shape {tuple(components.shape)}")
    weights = [1.0] * components.shape[1] if weights is None else list(weights)
    if len(weights) != components.shape[1]:
        raise ValueError(f"{len(weights)} reward_weights for {components.shape[1]} reward components")
    valid = torch.ones(components.shape[0], dtype=torch.bool, device=components.device)
    total = components.new_zeros(components.shape[0])
    for k, weight in enumerate(weights):
        part, _ = compute_advantages(components[:, k], prompt_ids, valid,
                                     use_leave_one_out_baseline=use_leave_one_out_baseline,
                                     normalize_rewards=normalize_rewards)
        total = total + weight * part
    std = total.std() if total.numel() > 1 else total.new_zeros(())
    advantages = (total - total.mean()) / std if std > 0 else total - total.mean()
    if advantage_clip_low is not None or advantage_clip_high is not None:
        advantages = advantages.clamp(min=advantage_clip_low, max=advantage_clip_high)
    return advantages, _metrics_all_valid(advantages, components.sum(dim=1), prompt_ids)


def _metrics_all_valid(advantages: Tensor, rewards: Tensor, prompt_ids: Sequence[str]) -> dict[str, float]:
    """`_metrics` for estimators that count every sample (Reinforce++, GDPO): rewards [B] laid out by group."""
    group, slot, num_groups, size = group_layout(prompt_ids)
    group, slot = group.to(rewards.device), slot.to(rewards.device)
    padded = rewards.new_zeros(num_groups, size)
    padded[group, slot] = rewards
    is_valid = torch.zeros(num_groups, size, dtype=torch.bool, device=rewards.device)
    is_valid[group, slot] = True
    return _metrics(advantages, padded, is_valid)


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
