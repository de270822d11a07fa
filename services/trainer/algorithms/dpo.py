"""Direct Preference Optimization: NeMo RL's DPOLossFn (nemo_rl/algorithms/loss/loss_functions.py).

Rows are pairs interleaved as in rm.py (row 2k chosen, row 2k+1 rejected). Per row i, with lp the
current and ref the frozen reference policy's logprobs of its tokens and tm its token mask:

    r_i  = Σ_t tm·(lp - ref)               preference_average_log_probs: / max(1, Σ_t tm)
    nll_i = -Σ_t tm·m_i·lp                 sft_average_log_probs:        / max(1, Σ_t tm·m_i)

    preference_loss = rm.py's Bradley-Terry loss of r with β = reference_policy_kl_penalty
    sft_loss        = Σ_k m[2k] · nll_{2k} / (N_seq / 2 + 1e-8)    chosen rows; 0 when sft_loss_weight = 0
    loss            = sft_loss_weight · sft_loss + preference_loss_weight · preference_loss

N_seq = Σ sample_mask over the WHOLE optimizer step (all micro-batches and ranks; NeMo RL's
`global_valid_seqs`), so every value is this micro-batch's share and they add up (ranks SUM gradients).
Metrics, as NeMo RL names them, all combine by sum: loss, sft_loss, preference_loss, accuracy
([r_chosen > r_rejected]), rewards_chosen_mean and rewards_rejected_mean (r itself, NOT scaled by β,
as NeMo RL reports them), num_valid_samples (pairs in this micro-batch).

Inputs are aligned with the response tokens: entry [i, t] is the logprob of token t of row i. NeMo RL
gets there by rolling the reference logprobs left by one and dropping the last column; that shift
happens before this module. The reference logprobs carry no gradient. Masks are 0/1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.trainer.algorithms.rm import preference_terms, split_pairs
from services.trainer.algorithms.sft import EPS, NLLInputs, sequence_nll


@dataclass(kw_only=True, slots=True)
class DPOLossConfig:
    """NeMo RL's `dpo:` loss keys (DPOLossConfig), with its defaults."""

    reference_policy_kl_penalty: float = 0.05
    """β: scales the implicit reward margin inside the sigmoid."""
    preference_loss_weight: float = 1.0
    """Weight of the preference (DPO) term."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL of the chosen responses; 0 skips it."""
    preference_average_log_probs: bool = False
    """Implicit reward per token (mean) instead of per sequence (sum)."""
    sft_average_log_probs: bool = False
    """SFT term per token (mean over each chosen response) instead of summed."""


@dataclass(kw_only=True, slots=True)
class DPOInputs:
    """One micro-batch of P pairs: 2P rows padded to T tokens, chosen and rejected interleaved."""

    reference_logprobs: Tensor
    """[2P, T] float: the frozen reference policy's logprobs of the same tokens, taken once per batch."""
    token_mask: Tensor
    """[2P, T] bool or 0/1: response tokens (not prompt or padding)."""
    sample_mask: Tensor
    """[2P] bool or 0/1: rows that carry loss; both rows of a pair share one value."""


def implicit_rewards(curr_logprobs: Tensor, data: DPOInputs, *, average: bool) -> Tensor:
    """[2P] Σ_t tm·(lp - ref) per row, or its mean over the row's tokens (at least 1)."""
    token_mask = data.token_mask.to(curr_logprobs.dtype)
    rewards = ((curr_logprobs - data.reference_logprobs) * token_mask).sum(-1)
    return rewards / token_mask.sum(-1).clamp(min=1) if average else rewards


def chosen_sft_loss(curr_logprobs: Tensor, data: DPOInputs, *, average: bool,
                    global_valid_seqs: float) -> Tensor:
    """The chosen responses' NLL, this micro-batch's share of the step's mean over pairs."""
    nll = sequence_nll(curr_logprobs, NLLInputs(token_mask=data.token_mask, sample_mask=data.sample_mask),
                       average=average)
    chosen, _ = split_pairs(nll)
    chosen_mask, _ = split_pairs(data.sample_mask.to(nll.dtype))
    return (chosen * chosen_mask).sum() / (global_valid_seqs / 2 + EPS)


def dpo_loss(curr_logprobs: Tensor, data: DPOInputs, cfg: DPOLossConfig, *, global_valid_seqs: float
             ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step's DPO loss.

    curr_logprobs: [2P, T] with grad. global_valid_seqs: Σ sample_mask over the step (rows, not pairs).
    """
    rewards = implicit_rewards(curr_logprobs, data, average=cfg.preference_average_log_probs)
    terms = preference_terms(rewards, data.sample_mask, beta=cfg.reference_policy_kl_penalty,
                             global_valid_seqs=global_valid_seqs)
    sft = torch.zeros((), dtype=curr_logprobs.dtype, device=curr_logprobs.device)
    if cfg.sft_loss_weight > 0:
        sft = chosen_sft_loss(curr_logprobs, data, average=cfg.sft_average_log_probs,
                              global_valid_seqs=global_valid_seqs)
    loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * terms["preference_loss"]
    metrics = {"loss": loss.item(), "sft_loss": sft.item()}
    metrics |= {name: value.item() for name, value in terms.items()}
    metrics["num_valid_samples"] = data.sample_mask.to(curr_logprobs.dtype).sum().item() / 2
    return loss, metrics
