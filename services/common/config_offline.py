"""The offline algorithms' config sections: NeMo RL's `sft:`, `dpo:` and `rm:` (examples/configs/{sft,dpo,rm}.yaml).

A run trains the algorithm whose section is present (at most one); with none it is GRPO. The
loop's own keys (max_num_steps, max_num_epochs, val_period, seed) drive the same machinery as
GRPO's: FlywheelConfig copies them onto `grpo.*` and `run.seed` (config.py, _offline_loop), so the
controller, replay and trainer count steps one way. One step is one batch of
policy.train_global_batch_size examples (SFT rows, or preference pairs for DPO and RM), served
by replay as one group each. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.common.config_base import Section
from services.common.nemo_rl_rules import Rule, is_, same_as

Algorithm = Literal["grpo", "sft", "dpo", "rm", "distillation"]
OFFLINE = ("sft", "dpo", "rm")
UNBOUNDED_STEPS = 10**9
"""grpo.max_num_steps for max_num_steps -1: the epochs end the run."""


class OfflineLoopConfig(Section):
    """The keys NeMo RL's SFT, DPO and RM loops share (SFTConfig, DPOConfig, RMConfig)."""

    max_num_steps: int = Field(100, ge=-1)
    """Optimizer steps in the run, at most; max_num_epochs may end it sooner. -1 (rm.yaml's): no limit but the
    epochs."""
    max_num_epochs: int = Field(1, gt=0)
    """Passes over data.train."""
    val_period: int = Field(0, ge=0)
    """Validation loss every val_period steps (0: none); the trainer computes it on data.validation."""
    val_batches: int = Field(0, ge=-1)
    """Validation batches per validation; 0 or -1: the whole validation set."""
    val_global_batch_size: int = Field(32, gt=0)
    """Examples per validation batch."""
    val_micro_batch_size: int = Field(1, gt=0)
    """Examples per validation forward."""
    val_at_start: bool = False
    """Validate the initial weights before the first step."""
    val_at_end: bool = False
    """Validate after the last step."""
    seed: int = 42
    """Copied to run.seed: model init, data order."""


class SFTSection(OfflineLoopConfig):
    """NeMo RL `sft:`: the loss is NLLLoss (services/trainer/algorithms/sft.py)."""


class DPOSection(OfflineLoopConfig):
    """NeMo RL `dpo:`: the loop keys and DPOLossConfig's (services/trainer/algorithms/dpo.py)."""

    reference_policy_kl_penalty: float = Field(0.05, ge=0)
    """β of the implicit reward margin."""
    preference_loss_weight: float = Field(1.0, ge=0)
    sft_loss_weight: float = Field(0.0, ge=0)
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False


class RMSection(OfflineLoopConfig):
    """NeMo RL `rm:`: Bradley-Terry on a scalar head (services/trainer/algorithms/rm.py)."""


def loss_keys(dpo: DPOSection) -> dict[str, float | bool]:
    """The `dpo:` keys DPOLossConfig takes, by name."""
    names = ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight",
             "preference_average_log_probs", "sft_average_log_probs")
    return {name: getattr(dpo, name) for name in names}


def _offline(_: Any, tree: dict) -> bool:
    return any(name in tree for name in OFFLINE)


OFFLINE_RULES: tuple[Rule, ...] = (
    Rule("sft.only_unmask_final", is_(False), "training on the final assistant turn only is not built: every "
         "assistant turn carries the loss"),
    Rule("data.add_bos", lambda v, tree: v is True or not _offline(v, tree),
         "offline rows start with the tokenizer's BOS (when it has one and the template gave none), as NeMo RL's "
         "add_bos: true; false is not built"),
    Rule("data.add_eos", lambda v, tree: v is True or not _offline(v, tree),
         "the last assistant turn ends with the tokenizer's EOS, as NeMo RL's add_eos: true; false is not built"),
    Rule("data.add_generation_prompt", lambda v, tree: v is False or not _offline(v, tree),
         "offline conversations are rendered without a generation prompt (the assistant turns are in the data)"),
    Rule("policy.reward_model_cfg", lambda v, tree: "rm" in tree and (v or {}).get("enabled") is True
         and (v or {}).get("reward_model_type", "bradley_terry") == "bradley_terry",
         "an rm: run's model is a Bradley-Terry scalar head (the only type NeMo RL has); it belongs to rm: runs"),
    Rule("policy.activation_checkpointing_enabled", same_as("policy.activation_checkpointing"),
         "rm.yaml's copy of the switch; the trainer reads policy.dtensor_cfg.activation_checkpointing"),
    Rule("policy.dtensor_cfg.dp_replicate_size", is_(1), "HSDP (replicated shards) is not built: FSDP2 shards "
         "over all data-parallel ranks"),
)
"""The keys of NeMo RL's sft.yaml, dpo.yaml and rm.yaml that Flywheel's schema lacks (nemo_rl.py appends them)."""
