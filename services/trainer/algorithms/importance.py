"""Off-policy correction: actor importance weights, their truncation, mismatch diagnostics.

Rollout samples with weights that may be older than the trainer's (staleness) and from an
engine whose numerics differ (vLLM vs the training framework). The loss reweights each
token by w = pi_prev / pi_gen, as NeMo RL's ClippedPGLossFn does (reference/nemo_rl.md §4.1
step 3). No gradient flows through w.

Shapes: logprobs and token masks are [B, T]; sample_mask is [B]; `mask` = token_mask *
sample_mask. Metrics are divided by the step's global valid token (or sequence) count, so
summing them over micro-batches and ranks gives the step value; *_max keys combine by max.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.common.config import LossConfig
from services.trainer.algorithms.kl import calculate_kl

EPS = 1e-8
"""Added to every denominator, as NeMo RL's masked_mean does."""


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def global_share(x: Tensor, mask: Tensor, total: float) -> float:
    """Σ x·mask / (total + EPS): one micro-batch's share of a step-wide mean."""
    return ((x * mask).sum() / (total + EPS)).item()


def actor_importance_weights(
    prev_logprobs: Tensor,
    generation_logprobs: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    cfg: LossConfig,
    *,
    global_valid_tokens: float,
    global_valid_seqs: float,
) -> tuple[Tensor, dict[str, float]]:
    """Detached, truncated importance weights: [B, T], or [B, 1] for GSPO.

    Token level w = exp(prev - gen). GSPO (sequence_level_importance_ratios) uses
    w_i = exp(Σ_t mask·(prev - gen)). Non-finite weights become 0. Truncation:
    tis clamps w to [ratio_min or 0, ratio]; icepop zeroes w outside [ratio_min, ratio];
    seq-mask-tis zeroes a whole sequence when exp(masked_mean_t(prev - gen)) is outside.
    Metrics: is_oob_ratio (only when truncating), sampling_importance_ratio (mean w, over
    sequences for GSPO else over tokens) and sampling_importance_ratio_max.
    """
    mask = token_mask * sample_mask[:, None]
    log_w = (prev_logprobs - generation_logprobs).detach()
    if cfg.sequence_level_importance_ratios:
        weights = _finite_or_zero(torch.exp((log_w * mask).sum(-1, keepdim=True)))
    else:
        weights = _finite_or_zero(torch.exp(log_w))
    totals = (global_valid_tokens, global_valid_seqs)
    weights, metrics = _truncate(weights, log_w, token_mask, sample_mask, cfg, *totals)

    if cfg.sequence_level_importance_ratios:
        metrics["sampling_importance_ratio"] = global_share(weights[:, 0], sample_mask, global_valid_seqs)
        valid = weights[:, 0][sample_mask.bool()]
    else:
        metrics["sampling_importance_ratio"] = global_share(weights, mask, global_valid_tokens)
        valid = weights[mask.bool()]
    metrics["sampling_importance_ratio_max"] = valid.max().item() if valid.numel() else float("-inf")
    return weights, metrics


def _truncate(
    weights: Tensor,
    log_w: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    cfg: LossConfig,
    global_valid_tokens: float,
    global_valid_seqs: float,
) -> tuple[Tensor, dict[str, float]]:
    kind, high = cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio
    low = cfg.truncated_importance_sampling_ratio_min
    if kind is None:
        return weights, {}
    mask = token_mask * sample_mask[:, None]
    if kind == "tis":
        low = 0.0 if low is None else low
        out = (weights > high) | (weights < low)
        oob = global_share(out.to(mask.dtype), mask, global_valid_tokens)
        return weights.clamp(low, high), {"is_oob_ratio": oob}
    if kind == "icepop":
        kept = (weights >= low) & (weights <= high)
        oob = global_share((~kept).to(mask.dtype), mask, global_valid_tokens)
        return torch.where(kept, weights, torch.zeros_like(weights)), {"is_oob_ratio": oob}
    if kind == "seq-mask-tis":
        mean_log_w = (_finite_or_zero(log_w) * token_mask).sum(-1) / (token_mask.sum(-1) + EPS)
        geo_mean = torch.exp(mean_log_w)
        kept = ((geo_mean >= low) & (geo_mean <= high)).to(weights.dtype)
        oob = global_share(1.0 - kept, sample_mask, global_valid_seqs)
        return weights * kept[:, None], {"is_oob_ratio": oob}
    raise ValueError(f"unknown truncated_importance_sampling_type {kind!r}")


def mismatch_metrics(
    prev_logprobs: Tensor,
    generation_logprobs: Tensor,
    mask: Tensor,
    kl_type: str,
    *,
    global_valid_tokens: float,
) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's, as NeMo RL reports it.

    token_mult_prob_error = mean exp(|gen - prev|·mask); gen_kl_error = KL(P_gen || P_train)
    and policy_kl_error = KL(P_train || P_gen), both with the configured estimator and no
    clamps; js_divergence_error = Jensen-Shannon divergence of the two, per sampled token.
    """
    prev, gen = prev_logprobs.detach(), generation_logprobs.detach()
    no_clamp = dict(input_clamp_value=None, output_clamp_value=None)
    gen_kl = calculate_kl(gen, prev, kl_type, **no_clamp)
    policy_kl = calculate_kl(prev, gen, kl_type, **no_clamp)
    log_mixture = torch.log(0.5 * prev.exp() + 0.5 * gen.exp())
    to_mixture_prev = (prev - log_mixture).exp() - (prev - log_mixture) - 1
    to_mixture_gen = (gen - log_mixture).exp() - (gen - log_mixture) - 1
    n = global_valid_tokens
    return {
        "token_mult_prob_error": global_share(torch.exp((gen - prev).abs() * mask), mask, n),
        "gen_kl_error": global_share(gen_kl, mask, n),
        "policy_kl_error": global_share(policy_kl, mask, n),
        "js_divergence_error": global_share(0.5 * to_mixture_prev + 0.5 * to_mixture_gen, mask, n),
    }


def mask_by_sequence_error(
    prev_logprobs: Tensor,
    generation_logprobs: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    rewards: Tensor,
    threshold: float,
) -> tuple[Tensor, dict[str, float]]:
    """NeMo RL's grpo.seq_logprob_error_threshold: drop the sequences the engine and the trainer disagree on.

    A sequence's error is token_mult_prob_error over its own loss tokens, mean_t exp(|gen - prev|); one above
    `threshold` leaves the loss (sample_mask 0). Returns the new [B] sample_mask and NeMo RL's metrics: the
    errors' max/mean/min over sequences with loss tokens, before and after the mask (0 when none is left),
    num_masked_seqs_by_logprob_error, and masked_correct_pct (the share of masked sequences with reward 1).
    """
    mask = token_mask * sample_mask[:, None]
    tokens = mask.sum(-1)
    valid = tokens > 0
    errors = (torch.exp((generation_logprobs - prev_logprobs).abs() * mask) * mask).sum(-1) / tokens.clamp(min=1)
    kept = (errors <= threshold).to(sample_mask.dtype) * sample_mask
    masked = (sample_mask - kept).bool()
    n_masked = int(masked.sum())
    metrics = {"num_masked_seqs_by_logprob_error": float(n_masked),
               "masked_correct_pct": (rewards[masked] == 1).float().mean().item() if n_masked else 0.0}
    for suffix, rows in (("", valid), ("_after_mask", valid & kept.bool())):
        picked = errors[rows]
        for stat in ("max", "mean", "min"):
            metrics[f"{stat}_seq_mult_prob_error{suffix}"] = getattr(picked, stat)().item() if picked.numel() else 0.0
    return kept, metrics
