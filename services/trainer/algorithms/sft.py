"""Supervised fine-tuning: NeMo RL's NLLLossFn (nemo_rl/algorithms/loss/loss_functions.py).

With lp the current logprobs of the target tokens and m = token_mask · sample_mask:

    loss = -Σ_{i,t} m[i,t] · lp[i,t] / (N_tok + 1e-8)

where N_tok = Σ token_mask · sample_mask over the WHOLE optimizer step (all micro-batches, all
data-parallel ranks), as NeMo RL's `global_valid_toks`. So each micro-batch returns its share of
the step's token mean, the shares add up to the step loss, and summing gradients over micro-batches
and ranks gives the gradient of that mean (ranks must SUM, not average, as for loss.py).

DPO's auxiliary SFT term (NLLLossFn with dpo_loss=True) is `sequence_nll`: one value per row,
-Σ_t m·lp, divided by max(1, Σ_t m) when averaged.

Inputs are aligned with the target tokens: entry [i, t] is the logprob of token t of row i (NeMo RL's
`token_mask[:, 1:]` shift happens before this module). Masks are 0/1.
Metrics use NeMo RL's names and all combine by sum over micro-batches and ranks: `loss` (the share),
`num_unmasked_tokens` and `num_valid_samples` (this micro-batch's counts).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

EPS = 1e-8
"""Added to the global normaliser, as NeMo RL's masked_mean does."""


@dataclass(kw_only=True, slots=True)
class NLLInputs:
    """One micro-batch of B rows padded to T target tokens."""

    token_mask: Tensor
    """[B, T] bool or 0/1: tokens that carry loss (assistant turns, not prompt or padding)."""
    sample_mask: Tensor
    """[B] bool or 0/1: rows that carry loss (NeMo RL's loss_multiplier)."""


def loss_mask(token_mask: Tensor, sample_mask: Tensor, dtype) -> Tensor:
    """[B, T] token_mask · sample_mask in dtype."""
    return token_mask.to(dtype) * sample_mask.to(dtype)[:, None]


def nll_loss(curr_logprobs: Tensor, data: NLLInputs, *, global_valid_tokens: float
             ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step's token-mean NLL.

    curr_logprobs: [B, T] with grad. global_valid_tokens: Σ token_mask · sample_mask over the step.
    """
    mask = loss_mask(data.token_mask, data.sample_mask, curr_logprobs.dtype)
    loss = -(curr_logprobs * mask).sum() / (global_valid_tokens + EPS)
    return loss, {
        "loss": loss.item(),
        "num_unmasked_tokens": mask.sum().item(),
        "num_valid_samples": data.sample_mask.to(curr_logprobs.dtype).sum().item(),
    }


def sequence_nll(curr_logprobs: Tensor, data: NLLInputs, *, average: bool) -> Tensor:
    """[B] NLL of each row: summed over its loss tokens, or averaged over them (at least 1)."""
    mask = loss_mask(data.token_mask, data.sample_mask, curr_logprobs.dtype)
    nll = -(curr_logprobs * mask).sum(-1)
    return nll / mask.sum(-1).clamp(min=1) if average else nll
