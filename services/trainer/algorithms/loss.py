"""The clipped policy-gradient loss of GRPO/DAPO/GSPO: NeMo RL's ClippedPGLossFn.

Per token (reference/nemo_rl.md §4.1), with lp the current logprobs:

    r      = exp(lp - prev)                  GSPO: exp(masked_mean_t(lp - prev)) per sequence
    r_clip = clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max)
    l      = max(-A·r, -A·r_clip)            dual clip: min(l, -c·A) where A < 0
                                             CISPO: l = -A·sg(r_clip)·lp
    loss   = reduce(w·l) + reduce(beta·KL)   w: importance.py, KL: kl.py

force_on_policy_ratio uses prev = sg(lp); disable_ppo_ratio uses r = r_clip = lp (REINFORCE).
`reduce` divides by the GLOBAL count of the optimizer step: valid tokens (token_level_loss)
or valid sequences, each sequence first averaged over its own tokens. So the summed
micro-batch losses have the gradient of the step-wide mean, whatever the micro-batching
and data-parallel split (ranks must SUM gradients, not average them).

Inputs are already aligned with the sampled tokens: entry [i, t] is the logprob of token t
of response i; NeMo RL's `[:, 1:]` shift happens before this module.
Metrics use NeMo RL's names. Keys ending in _min/_max combine across micro-batches by min/max;
all others are already divided by the global counts and combine by sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.config import LossConfig
from services.trainer.algorithms.importance import (
    EPS,
    actor_importance_weights,
    global_share,
    mismatch_metrics,
)
from services.trainer.algorithms.kl import reference_kl_per_token


@dataclass(kw_only=True, slots=True)
class LossInputs:
    """One micro-batch of B responses padded to T tokens."""

    prev_logprobs: Tensor | None
    """[B, T] float: logprobs under the weights before this step, recomputed by the trainer (nats). None when
    this is the batch's only optimizer step: those weights are the ones being trained, so prev = sg(lp)."""
    generation_logprobs: Tensor
    """[B, T] float: the same tokens' logprobs as reported by the rollout engine (nats)."""
    reference_logprobs: Tensor | None = None
    """[B, T] float: reference-policy logprobs; needed only when reference_policy_kl_penalty > 0."""
    advantages: Tensor
    """[B, T] or [B] float: advantage per token, or per response (broadcast over its tokens)."""
    token_mask: Tensor
    """[B, T] bool or 0/1: tokens that carry loss (response tokens, not prompt or padding)."""
    sample_mask: Tensor
    """[B] bool or 0/1: responses that carry loss (NeMo RL's loss_multiplier)."""


def reduce_per_token(
    values: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    *,
    token_level: bool,
    global_valid_tokens: float,
    global_valid_seqs: float,
) -> Tensor:
    """Scalar share of this micro-batch in the step's token mean or sequence mean of values [B, T]."""
    if token_level:
        return (values * token_mask * sample_mask[:, None]).sum() / (global_valid_tokens + EPS)
    per_sequence = (values * token_mask).sum(-1) / (token_mask.sum(-1) + EPS)
    return (per_sequence * sample_mask).sum() / (global_valid_seqs + EPS)


def _ratios(curr: Tensor, prev: Tensor, token_mask: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """(r, r_clip), both [B, T] and differentiable in curr."""
    if cfg.force_on_policy_ratio:
        ratio = torch.exp(curr - curr.detach())
        return ratio, ratio
    if cfg.disable_ppo_ratio:
        return curr, curr
    log_ratio = curr - prev
    if cfg.sequence_level_importance_ratios:
        mean = (log_ratio * token_mask).sum(-1, keepdim=True) / (token_mask.sum(-1, keepdim=True) + EPS)
        ratio = mean.exp().expand_as(curr)
    else:
        ratio = log_ratio.exp()
    return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def _surrogate(advantages: Tensor, ratio: Tensor, clipped: Tensor, curr: Tensor, cfg: LossConfig) -> Tensor:
    """Per token [B, T]: the pessimistic clipped surrogate, dual-clipped for negative advantages; or CISPO's
    REINFORCE term weighted by the clipped ratio, which carries no gradient itself."""
    if cfg.use_cispo:
        return -advantages * clipped.detach() * curr
    loss = torch.max(-advantages * ratio, -advantages * clipped)
    if cfg.ratio_clip_c is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -advantages * cfg.ratio_clip_c), loss)
    return loss


def clipped_pg_loss(
    curr_logprobs: Tensor,
    data: LossInputs,
    cfg: LossConfig,
    *,
    global_valid_tokens: float,
    global_valid_seqs: float,
) -> tuple[Tensor, dict[str, float]]:
    """Loss of one micro-batch, scaled so that the sum over the step's micro-batches is the step loss.

    curr_logprobs: [B, T] with grad. global_valid_tokens = Σ token_mask·sample_mask and
    global_valid_seqs = Σ sample_mask over the whole optimizer step (all micro-batches, all ranks).
    """
    dtype = curr_logprobs.dtype
    token_mask = data.token_mask.to(dtype)
    sample_mask = data.sample_mask.to(dtype)
    mask = token_mask * sample_mask[:, None]
    advantages = data.advantages if data.advantages.dim() == 2 else data.advantages[:, None]
    advantages = advantages.to(dtype).expand_as(curr_logprobs)
    prev = curr_logprobs.detach() if cfg.force_on_policy_ratio or data.prev_logprobs is None else data.prev_logprobs
    generation = data.generation_logprobs
    totals = dict(global_valid_tokens=global_valid_tokens, global_valid_seqs=global_valid_seqs)
    reduce = dict(token_level=cfg.token_level_loss, **totals)

    ratio, clipped = _ratios(curr_logprobs, prev, token_mask, cfg)
    surrogate = _surrogate(advantages, ratio, clipped, curr_logprobs, cfg)
    weights, metrics = actor_importance_weights(prev, generation, token_mask, sample_mask, cfg, **totals)
    if not cfg.use_importance_sampling_correction:
        weights = torch.ones_like(weights)
    actor_loss = reduce_per_token(weights * surrogate, token_mask, sample_mask, **reduce)

    beta = cfg.reference_policy_kl_penalty
    kl = torch.zeros((), dtype=dtype, device=curr_logprobs.device)
    if beta != 0:
        if data.reference_logprobs is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs reference_logprobs")
        kl_tokens = reference_kl_per_token(curr_logprobs, data.reference_logprobs, generation, cfg)
        kl = reduce_per_token(kl_tokens, token_mask, sample_mask, **reduce)
    loss = actor_loss + kl

    with torch.no_grad():
        metrics |= _ratio_metrics(ratio, clipped, advantages, mask, cfg, global_valid_tokens)
        metrics |= mismatch_metrics(
            prev, generation, mask, cfg.reference_policy_kl_type, global_valid_tokens=global_valid_tokens
        )
        entropy = -torch.exp(curr_logprobs - generation) * curr_logprobs
        metrics["approx_entropy"] = global_share(entropy, mask, global_valid_tokens)
        metrics["kl_penalty"] = kl.item() / beta if beta != 0 else 0.0
        metrics["num_valid_samples"] = sample_mask.sum().item()
        metrics["loss"] = loss.item()
    return loss, metrics


def _ratio_metrics(
    ratio: Tensor, clipped: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig, total: float
) -> dict[str, float]:
    """probs_ratio* as NeMo RL names them, plus where the clip binds (the gradient is cut).

    clip_fraction_low: A < 0 and r < 1 - ratio_clip_min; clip_fraction_high: A > 0 and
    r > 1 + ratio_clip_max; dual_clip_fraction: A < 0 and the dual clip -c·A is the loss.
    Under CISPO the clip never cuts the gradient; the fractions count the tokens whose weight it bounds,
    whatever the sign of A. Not meaningful under disable_ppo_ratio, where r is the logprob itself.
    """
    ratio, clipped = ratio.detach(), clipped.detach()
    valid = mask.bool()

    def share(x: Tensor) -> float:
        return global_share(x.to(mask.dtype), mask, total)

    negative, positive = (True, True) if cfg.use_cispo else (advantages < 0, advantages > 0)
    metrics = {
        "probs_ratio": share(ratio),
        "probs_ratio_clamped": share(clipped),
        "clip_fraction_low": share(negative & (ratio < 1.0 - cfg.ratio_clip_min)),
        "clip_fraction_high": share(positive & (ratio > 1.0 + cfg.ratio_clip_max)),
    }
    if cfg.ratio_clip_c is not None:
        unclipped = torch.max(-advantages * ratio, -advantages * clipped)
        metrics["dual_clip_fraction"] = share((advantages < 0) & (unclipped > -advantages * cfg.ratio_clip_c))
    some = bool(valid.any())
    for name, x in (("probs_ratio", ratio), ("probs_ratio_clamped", clipped)):
        metrics[f"{name}_min"] = x[valid].min().item() if some else float("inf")
        metrics[f"{name}_max"] = x[valid].max().item() if some else float("-inf")
    return metrics
