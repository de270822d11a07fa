"""Reward-model training: the Bradley-Terry preference loss, NeMo RL's PreferenceLossFn
(nemo_rl/algorithms/loss/loss_functions.py; nemo_rl/algorithms/rm.py builds it with no arguments).

Rows come in pairs as NeMo RL's preference_collate_fn interleaves them: row 2k is pair k's chosen
response, row 2k+1 its rejected one. With r the rewards, c_k = r[2k], j_k = r[2k+1], m the sample mask
(0/1) and N_pair = N_seq / 2, where N_seq = Σ sample_mask over the WHOLE optimizer step (all
micro-batches and data-parallel ranks; NeMo RL's `global_valid_seqs`):

    preference_loss       = Σ_k m[2k] · -log σ(β · (c_k - j_k)) / (N_pair + 1e-8)
    accuracy              = Σ_k m[2k] · [c_k > j_k]             / (N_pair + 1e-8)
    rewards_chosen_mean   = Σ_k m[2k] · c_k                     / (N_pair + 1e-8)
    rewards_rejected_mean = Σ_k m[2k+1] · j_k                   / (N_pair + 1e-8)
    num_valid_samples     = Σ_i m[i] / 2                          (pairs in this micro-batch)

The reward model uses β = 1 and r = its scalar score of each whole sequence; DPO (dpo.py) reuses these
terms with β = reference_policy_kl_penalty and its implicit rewards. Every metric is a share of the
step's value, so all of them combine by sum over micro-batches and ranks, as NeMo RL's driver sums them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.trainer.algorithms.sft import EPS


@dataclass(kw_only=True, slots=True)
class PreferenceInputs:
    """One micro-batch of P pairs, 2P rows, chosen and rejected interleaved."""

    sample_mask: Tensor
    """[2P] bool or 0/1: rows that carry loss (NeMo RL's loss_multiplier); both rows of a pair share one."""


def split_pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """(chosen rows, rejected rows) of an interleaved [2P, ...] tensor."""
    if x.shape[0] % 2:
        raise ValueError(f"preference rows come in (chosen, rejected) pairs; got {x.shape[0]} rows")
    return x[::2], x[1::2]


def preference_terms(
    rewards: Tensor, sample_mask: Tensor, *, beta: float, global_valid_seqs: float
) -> dict[str, Tensor]:
    """The formulas above as scalar tensors; only `preference_loss` carries a gradient."""
    chosen, rejected = split_pairs(rewards)
    chosen_mask, rejected_mask = (m.to(rewards.dtype) for m in split_pairs(sample_mask))
    pairs = global_valid_seqs / 2 + EPS
    per_pair = -torch.nn.functional.logsigmoid(beta * (chosen - rejected))
    terms = {"preference_loss": (per_pair * chosen_mask).sum() / pairs}
    with torch.no_grad():
        terms["accuracy"] = ((chosen > rejected).to(rewards.dtype) * chosen_mask).sum() / pairs
        terms["rewards_chosen_mean"] = (chosen * chosen_mask).sum() / pairs
        terms["rewards_rejected_mean"] = (rejected * rejected_mask).sum() / pairs
    return terms


def preference_loss(rewards: Tensor, data: PreferenceInputs, *, global_valid_seqs: float
                    ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step's Bradley-Terry loss.

    rewards: [2P] (or [2P, 1], a value head's output) with grad. global_valid_seqs: Σ sample_mask over
    the step, counting both rows of each pair.
    """
    rewards = rewards.squeeze(-1) if rewards.dim() == 2 else rewards
    terms = preference_terms(rewards, data.sample_mask, beta=1.0, global_valid_seqs=global_valid_seqs)
    loss = terms["preference_loss"]
    metrics = {name: value.item() for name, value in terms.items() if name != "preference_loss"}
    metrics["num_valid_samples"] = data.sample_mask.to(rewards.dtype).sum().item() / 2
    return loss, {"loss": loss.item(), **metrics}
