"""On-policy distillation's config: NeMo RL's `distillation:` and `teacher:` sections (distillation_math.yaml).

A run with a `distillation:` section trains the student (policy.*) on the KL to a teacher's top-k
(services/trainer/algorithms/distillation.py) instead of GRPO's loss. Rollout samples with the
student as under GRPO, so the loop's keys drive the same machinery: FlywheelConfig copies them onto
`grpo.*` and `run.seed` (config.py, _distillation_loop), and grpo.async_grpo (max_trajectory_age_steps)
bounds staleness unchanged. The loss's keys are NeMo RL's `loss_fn.kl_type`, `mixed_kl_weight` and
`zero_outside_topk` (LossConfig). Imports no torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.common.config_base import Section
from services.common.nemo_rl_rules import Rule, any_, get

DISTILLATION_LOSS_KEYS = frozenset({"kl_type", "mixed_kl_weight", "zero_outside_topk"})
"""loss_fn.* keys of NeMo RL's DistillationLossConfig; every other loss_fn key is GRPO's ClippedPGLossFn's."""
LOOP_KEYS = ("num_prompts_per_step", "num_generations_per_prompt", "max_rollout_turns", "max_num_steps",
             "max_num_epochs", "val_period", "val_at_start", "val_at_end", "max_val_samples")
"""distillation.* keys that mean the grpo.* key of the same name."""
GRPO_KEYS_KEPT = frozenset({"async_grpo"})
"""grpo.* keys a distillation run reads: the staleness bound. The others are GRPO's advantages and loop."""


class DistillationSection(Section):
    """NeMo RL `distillation:` (DistillationConfig), with its defaults."""

    num_prompts_per_step: int = Field(128, gt=0)
    """Prompts in one step (grpo.num_prompts_per_step)."""
    num_generations_per_prompt: int = Field(1, gt=0)
    """Student samples per prompt (grpo.num_generations_per_prompt)."""
    max_rollout_turns: int = Field(1, gt=0)
    """Environment turns per episode."""
    max_num_steps: int = Field(1000, gt=0)
    """Trainer steps in the run, at most."""
    max_num_epochs: int = Field(10, gt=0)
    """Passes over data.train."""
    val_period: int = Field(20, ge=-1)
    """Validate every val_period steps (0 or -1: never), as under GRPO: the controller samples and scores."""
    val_at_start: bool = False
    val_at_end: bool = False
    max_val_samples: int | None = Field(512, gt=0)
    """Validation prompts used, at most; null: all."""
    topk_logits_k: int = Field(64, gt=0)
    """k: the teacher's logits kept at each position (copied to teacher.topk_logits_k)."""
    seed: int = 42
    """Copied to run.seed."""
    env_reward_weight: float = Field(0.0, ge=0)
    """Flywheel's, not NeMo RL's (whose distillation loss has no reward): w > 0 adds w × GRPO's clipped policy-gradient
    loss on the environment's reward (GRPO advantages and loss_fn defaults) to the KL. Needs 2+ generations a prompt."""


def copy_loop(loop: DistillationSection, grpo: Any, teacher: Any) -> int:
    """distillation.* onto grpo.* and teacher.topk_logits_k; returns the seed for run.seed."""
    for key in LOOP_KEYS:
        setattr(grpo, key, getattr(loop, key))
    teacher.topk_logits_k = loop.topk_logits_k
    return loop.seed


def changed(section: Any) -> set[str]:
    """The fields of a config section whose value is not its default's, as validated (a resolved config written back
    sets every field, so which fields were written says nothing)."""
    default = type(section)()
    return {name for name in type(section).model_fields if getattr(section, name) != getattr(default, name)}


def distillation_problems(cfg: Any) -> list[str]:
    """What a distillation run cannot take (cfg: FlywheelConfig), one reason each."""
    out = []
    if cfg.teacher.model_name is None:
        out.append("teacher.model_name: a distillation run needs a teacher (a Hugging Face id or directory)")
    pg_keys = sorted(changed(cfg.loss_fn) - DISTILLATION_LOSS_KEYS)
    if pg_keys:
        out.append(f"loss_fn {pg_keys}: GRPO's clipped policy-gradient keys; a distillation run's loss is NeMo RL's "
                   f"DistillationLossFn, which reads only {sorted(DISTILLATION_LOSS_KEYS)}")
    copied = {key for key in LOOP_KEYS if getattr(cfg.grpo, key) == getattr(cfg.distillation, key)}
    grpo_keys = sorted(changed(cfg.grpo) - GRPO_KEYS_KEPT - copied)
    if grpo_keys:
        out.append(f"grpo {grpo_keys}: set the loop under distillation.* (a distillation run reads only "
                   f"grpo.async_grpo, its staleness bound)")
    if cfg.policy.megatron_cfg.enabled:
        out.append("policy.megatron_cfg.enabled: the distillation step is the FSDP2 backend's; set it false")
    if cfg.distillation.env_reward_weight and cfg.distillation.num_generations_per_prompt < 2:
        out.append("distillation.env_reward_weight: GRPO's advantages need distillation.num_generations_per_prompt >= 2")
    if cfg.policy.lora_cfg.enabled:
        out.append("policy.lora_cfg: LoRA with distillation is not built")
    return out


def _no_optimizer(why: str) -> str:
    return f"the teacher only scores (no optimizer, no gradients): {why}"


TEACHER_SCORES = ("the teacher service runs each replica whole in one process; its layout and batching change speed, "
                  "not the top-k")
DISTILLATION_RULES: tuple[Rule, ...] = (
    Rule("distillation.val_batch_size", any_, "validation prompts go to rollout one request each"),
    *(Rule(f"teacher.{key}", any_, _no_optimizer(f"{key} is a training key")) for key in (
        "train_global_batch_size", "train_micro_batch_size", "optimizer", "scheduler", "max_grad_norm",
        "offload_optimizer_for_logprob", "generation_batch_size")),
    Rule("teacher.megatron_cfg", lambda v, _: not (v or {}).get("enabled"), "the teacher runs as a Hugging Face "
         "model in the teacher service; Megatron-Core teachers are not built"),
    Rule("teacher.dtensor_cfg", lambda v, _: not (v or {}).get("cpu_offload") and (v or {}).get("enabled", True),
         TEACHER_SCORES),
    Rule("teacher.dynamic_batching", any_, TEACHER_SCORES),
    Rule("teacher.sequence_packing", any_, TEACHER_SCORES),
    Rule("teacher.logprob_batch_size", any_, TEACHER_SCORES),
    Rule("teacher.logprob_chunk_size", any_, TEACHER_SCORES),
    Rule("teacher.make_sequence_length_divisible_by", any_, TEACHER_SCORES),
    Rule("teacher.max_total_sequence_length",
         lambda v, tree: v is None or v >= get(tree, "policy.max_total_sequence_length", 0),
         "the teacher scores the student's whole sequences, up to policy.max_total_sequence_length"),
    Rule("teacher.tokenizer.name", lambda v, tree: v in (None, get(tree, "teacher.model_name")),
         "the teacher's tokenizer is its model's, and must be the student's (checked before the run starts)"),
    Rule("teacher.tokenizer.chat_template_kwargs", any_,
         "the teacher scores the student's token ids; no chat template is applied"),
    Rule("teacher.tokenizer.chat_template", any_,
         "the teacher scores the student's token ids; no chat template is applied"),
    Rule("teacher.generation.*", any_, "the teacher does not generate; it scores the student's samples (of its "
         "generation section only the temperature changes the scores: TeacherConfig.generation)"),
)
"""The keys of NeMo RL's distillation_math.yaml that Flywheel's schema lacks (nemo_rl.py appends them)."""

