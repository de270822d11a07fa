"""Per-token KL estimates: the reference-policy penalty and the KL mismatch diagnostics.

This owns NeMo RL's `calculate_kl` (Schulman's k1/k2/k3 estimators with input and output
clamps) and the reference KL term of ClippedPGLossFn (reference/nemo_rl.md §4.1 step 5).
All tensors are [B, T], aligned with the sampled tokens; reductions live in loss.py.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from services.common.config import LossConfig

KLType = Literal["k1", "k2", "k3"]


def calculate_kl(
    logprobs: Tensor,
    logprobs_reference: Tensor,
    kl_type: KLType,
    *,
    input_clamp_value: float | None,
    output_clamp_value: float | None,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """Estimate of KL(p || p_ref) per token, from samples of p.

    With logr = logprobs_reference - logprobs: k1 = -logr, k2 = logr^2 / 2,
    k3 = exp(logr) - 1 - logr. Where the input clamp binds, the importance weight is
    detached, so the clamp stops both the KL and the sampling-weight gradients.
    The weight multiplies the estimate before the output clamp. Returns [B, T].
    """
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        clamped = logr.clamp(-input_clamp_value, input_clamp_value)
        if importance_weights is not None:
            importance_weights = torch.where(logr == clamped, importance_weights, importance_weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = logr.exp() - 1 - logr
    else:
        raise ValueError(f"unknown KL type {kl_type!r}")
    if importance_weights is not None:
        kl = importance_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def reference_kl_per_token(
    curr_logprobs: Tensor, reference_logprobs: Tensor, generation_logprobs: Tensor, cfg: LossConfig
) -> Tensor:
    """beta * KL(pi_theta || pi_ref) per token [B, T], with gradient through curr_logprobs.

    The tokens were sampled from the generator, so the estimate is weighted by
    exp(curr - generation) under use_on_policy_kl_approximation, and otherwise by
    exp(curr - sg(curr)): 1 in value, but it carries the score-function gradient.
    """
    if cfg.use_on_policy_kl_approximation:
        weights = torch.exp(curr_logprobs - generation_logprobs)
    else:
        weights = torch.exp(curr_logprobs - curr_logprobs.detach())
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    kl = calculate_kl(
        curr_logprobs,
        reference_logprobs,
        cfg.reference_policy_kl_type,
        input_clamp_value=cfg.kl_input_clamp_value,
        output_clamp_value=cfg.kl_output_clamp_value,
        importance_weights=weights,
    )
    return cfg.reference_policy_kl_penalty * kl
