"""Training math: GRPO's advantages (and NeMo RL's overrides for flawed turns), clipped policy-gradient loss,
off-policy correction and DAPO helpers; the offline losses of SFT (sft.py), DPO (dpo.py) and reward-model
training (rm.py).

Pure and IO-free: these modules import torch and services.common.config only, and every
function returns `(value, metrics)` where it has metrics. Semantics follow NeMo RL
(see /work/shared/reference/nemo_rl.md §3-4 and docs/nemo_rl_mapping.md).
"""

from services.trainer.algorithms.advantages import (compute_advantages, gdpo_advantages, group_layout,
                                                    reinforce_plus_plus_advantages)
from services.trainer.algorithms.dapo import overlong_reward_penalty
from services.trainer.algorithms.distillation import DistillationInputs, DistillationLossConfig, distillation_loss
from services.trainer.algorithms.dpo import DPOInputs, DPOLossConfig, dpo_loss
from services.trainer.algorithms.flaws import flawed_turn_advantages
from services.trainer.algorithms.importance import actor_importance_weights, mask_by_sequence_error, mismatch_metrics
from services.trainer.algorithms.kl import calculate_kl, reference_kl_per_token
from services.trainer.algorithms.loss import LossInputs, clipped_pg_loss, reduce_per_token
from services.trainer.algorithms.rm import PreferenceInputs, preference_loss
from services.trainer.algorithms.sft import NLLInputs, nll_loss

__all__ = [
    "DPOInputs",
    "DPOLossConfig",
    "DistillationInputs",
    "DistillationLossConfig",
    "LossInputs",
    "NLLInputs",
    "PreferenceInputs",
    "actor_importance_weights",
    "calculate_kl",
    "clipped_pg_loss",
    "compute_advantages",
    "distillation_loss",
    "dpo_loss",
    "flawed_turn_advantages",
    "gdpo_advantages",
    "group_layout",
    "mask_by_sequence_error",
    "mismatch_metrics",
    "nll_loss",
    "overlong_reward_penalty",
    "preference_loss",
    "reduce_per_token",
    "reference_kl_per_token",
    "reinforce_plus_plus_advantages",
]
