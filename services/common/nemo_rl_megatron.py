"""NeMo RL's `policy.megatron_cfg` -> the Flywheel keys the trainers read, or a refusal with its reason.

    megatron_cfg.enabled false ──▶ every megatron_cfg key inert (one note), as in NeMo RL
    megatron_cfg.enabled true  ──▶ prepare(): optimizer + scheduler -> policy.optimizer / policy.scheduler (torch
                                   classes with Megatron's schedule), clip_grad -> policy.max_grad_norm,
                                   activation_checkpointing -> policy.activation_checkpointing; dtensor_cfg and
                                   the DTensor optimizer keys inert (NeMo RL runs one backend)
                               ──▶ RULES: each other key accepted at the values services/trainer/backends/megatron.py
                                   runs (a note says why it changes nothing there), refused otherwise with the reason

A key under megatron_cfg that no rule names is left to the schema, which reports it unknown. The schedule is
Megatron's OptimizerParamScheduler, stepped once per trainer step as NeMo RL's Megatron worker steps it:
a linear warm-up from lr_warmup_init to lr over lr_warmup_iters, then constant, linear or cosine decay to min_lr
at lr_decay_iters (null: grpo.max_num_steps), then min_lr.
"""

from __future__ import annotations

from typing import Any

from services.common.config_loader import Problem
from services.common.nemo_rl_optim import megatron_optimizer, number, schedule
from services.common.nemo_rl_rules import Rule, any_, get, is_, off, same_as, when

M = "policy.megatron_cfg"
KERNEL = "a kernel or fusion choice: speed, not the math"


def enabled(tree: dict) -> bool:
    return bool(get(tree, f"{M}.enabled", False))


def _with(parent: str) -> str:
    """Why a key that only its parent feature reads is accepted: the parent is off, or refused on its own."""
    return f"read only with {parent}, which is off here or refused with its own reason"


def _dtype_flag(precision: str):
    return lambda v, tree: bool(v) == (get(tree, "policy.precision") == precision)


INERT = (Rule(f"{M}.*", when(f"{M}.enabled", False),
              "inert while megatron_cfg.enabled is false, as in NeMo RL"),)
"""The rule for every megatron_cfg key when the FSDP2 trainer runs."""

RULES: tuple[Rule, ...] = (
    Rule(f"{M}.expert_tensor_parallel_size", lambda v, _: v in (1, None),
         "each rank of expert_model_parallel_size holds whole experts: expert tensor parallelism is not built"),
    Rule(f"{M}.moe_enable_deepep", is_(False), "DeepEP's dispatcher is not built (moe_token_dispatcher_type "
         "alltoall or allgather)"),
    Rule(f"{M}.moe_flex_dispatcher_backend", any_, _with("moe_token_dispatcher_type flex")),
    Rule(f"{M}.moe_hybridep_num_sms", any_, _with("moe_token_dispatcher_type flex")),
    Rule(f"{M}.moe_router_bias_update_rate", any_, _with("moe_router_enable_expert_bias")),
    *(Rule(f"{M}.{k}", any_, KERNEL) for k in ("moe_permute_fusion", "moe_grouped_gemm", "moe_shared_expert_overlap")),
    Rule(f"{M}.moe_per_layer_logging", any_, "a log"),
    Rule(f"{M}.pipeline_dtype", same_as("policy.precision"),
         "pipeline stages exchange activations at policy.precision"),
    Rule(f"{M}.recompute_granularity", lambda v, t: v == "full" or not get(t, "policy.activation_checkpointing"),
         "activation checkpointing (policy.activation_checkpointing) recomputes whole layers: full granularity"),
    Rule(f"{M}.recompute_modules", any_, _with("recompute_granularity selective")),
    Rule(f"{M}.empty_unused_memory_level", any_,
         "frees memory for colocated generation; rollout runs in its own processes here"),
    Rule(f"{M}.force_reconvert_from_hf", any_, "the backend converts the Hugging Face weights at every start"),
    Rule(f"{M}.converter_type", any_, "the Hugging Face -> Megatron conversion follows the model's own config"),
    Rule(f"{M}.cuda_graph_impl", is_("none"), "CUDA graphs in training are not built"),
    Rule(f"{M}.cuda_graph_modules", any_, _with("cuda_graph_impl")),
    Rule(f"{M}.cuda_graph_warmup_steps", any_, _with("cuda_graph_impl")),
    Rule(f"{M}.fine_grained_activation_offloading", is_(False), "activation offloading is not built"),
    Rule(f"{M}.offload_modules", any_, _with("fine_grained_activation_offloading")),
    Rule(f"{M}.use_gloo_process_groups", any_, "process-group plumbing; the collectives compute the same"),
    *(Rule(f"{M}.{k}", any_, KERNEL) for k in ("apply_rope_fusion", "bias_activation_fusion", "attention_backend",
                                                "gradient_accumulation_fusion", "use_fused_weighted_squared_relu")),
    Rule(f"{M}.defer_fp32_logits", any_, "the backend takes log-probabilities in float32 from the logits either way"),
    Rule(f"{M}.mtp_num_layers", lambda v, _: not v, "multi-token prediction is not built"),
    Rule(f"{M}.mtp_*", any_, _with("mtp_num_layers")),
    Rule(f"{M}.peft", off, "Megatron-Core LoRA is not built (LoRA is the FSDP2 trainer's: policy.lora_cfg)"),
    Rule(f"{M}.fp8_cfg", off, "FP8 training is not built"),
    Rule(f"{M}.model_overrides", lambda v, _: not v,
         "Megatron model-provider overrides: set the model's attributes with policy.hf_config_overrides"),
    Rule(f"{M}.freeze_config", lambda v, _: not any((v or {}).values()),
         "freezing parts of a vision-language model is not built"),
    Rule(f"{M}.checkpoint.async_save", any_, "checkpoints are written before the step returns"),
    Rule(f"{M}.checkpoint.ckpt_assume_constant_structure", any_, "a dist_checkpointing speed-up"),
    Rule(f"{M}.use_fused_linear_logprobs", is_(False), "fused linear log-probabilities are not built"),
    Rule(f"{M}.fused_linear_logprobs_chunk_size", any_, _with("use_fused_linear_logprobs")),
    Rule(f"{M}.optimizer.bf16", _dtype_flag("bfloat16"), "the backend computes in bfloat16 when policy.precision is"),
    Rule(f"{M}.optimizer.fp16", _dtype_flag("float16"), "the backend computes in float16 when policy.precision is"),
    Rule(f"{M}.optimizer.params_dtype", is_("float32"), "the backend keeps float32 parameters and steps on them"),
    Rule(f"{M}.optimizer.use_distributed_optimizer", any_, "sharding the optimizer state over data-parallel "
         "ranks saves memory, not the update: the backend keeps each rank's whole optimizer state"),
    Rule(f"{M}.optimizer.use_precision_aware_optimizer", any_,
         "with its default float32 states it takes the same step as the plain optimizer"),
    Rule(f"{M}.optimizer.sgd_momentum", any_, _with("optimizer sgd")),
    Rule(f"{M}.optimizer.min_lr", any_, _with("megatron_cfg.scheduler")),
    Rule(f"{M}.optimizer.optimizer_cpu_offload", is_(False),
         "optimizer offload is not built for Megatron (policy.cpu_offload is the FSDP2 trainer's)"),
    Rule(f"{M}.optimizer.optimizer_offload_fraction", any_, _with("optimizer_cpu_offload")),
    Rule(f"{M}.optimizer.overlap_cpu_optimizer_d2h_h2d", any_, _with("optimizer_cpu_offload")),
    Rule(f"{M}.scheduler.start_weight_decay", same_as("policy.optimizer.kwargs.weight_decay"),
         "a weight-decay schedule is not built: the decay stays optimizer.weight_decay"),
    Rule(f"{M}.scheduler.end_weight_decay", same_as("policy.optimizer.kwargs.weight_decay"),
         "a weight-decay schedule is not built: the decay stays optimizer.weight_decay"),
    Rule(f"{M}.scheduler.override_opt_param_scheduler", any_, "which schedule wins when a resumed run's config "
         "differs from its checkpoint's: a resume restores the checkpoint's schedule state, the same schedule when "
         "the config is unchanged"),
    Rule(f"{M}.scheduler.weight_decay_incr_style", lambda v, t: v == "constant" or get(
        t, f"{M}.scheduler.start_weight_decay") == get(t, f"{M}.scheduler.end_weight_decay"),
         "inert while start and end weight decay are equal"),
    Rule(f"{M}.distributed_data_parallel_config.grad_reduce_in_fp32", any_,
         "the backend reduces gradients in float32 always, at least as exact as bfloat16"),
    Rule(f"{M}.distributed_data_parallel_config.overlap_grad_reduce", any_, "overlaps communication: speed only"),
    Rule(f"{M}.distributed_data_parallel_config.overlap_param_gather", any_, "overlaps communication: speed only"),
    Rule(f"{M}.distributed_data_parallel_config.use_custom_fsdp", is_(False), "Megatron's custom FSDP is not built"),
    Rule(f"{M}.distributed_data_parallel_config.data_parallel_sharding_strategy", any_, _with("use_custom_fsdp")),
)
"""The rules for megatron_cfg keys while it is enabled, besides those prepare() takes."""


def prepare(tree: dict, problems: list[Problem], notes: list[Problem]) -> None:
    """With megatron_cfg.enabled: take its optimizer, scheduler, clip_grad and activation_checkpointing onto the
    Flywheel keys the backends read, and set aside what NeMo RL's Megatron path leaves unread. Changes `tree`."""
    if not enabled(tree):
        return
    policy, m = tree["policy"], tree["policy"]["megatron_cfg"]
    _train_iters(m, problems, notes)
    for part in (m.get("optimizer"), m.get("scheduler")):
        if isinstance(part, dict):
            part.update({k: number(v) for k, v in part.items()})
    _inert_dtensor(policy, problems, notes)
    if isinstance(m.get("optimizer"), dict):
        _set_inert(policy, "optimizer", megatron_optimizer(m["optimizer"], problems), notes, "megatron_cfg.optimizer")
        clip = m["optimizer"].pop("clip_grad", None)
        if clip is not None:
            _set_inert(policy, "max_grad_norm", clip or None, notes, "megatron_cfg.optimizer.clip_grad")
        if isinstance(m.get("scheduler"), dict) and isinstance(policy["optimizer"]["kwargs"]["lr"], float | int):
            lr, low = policy["optimizer"]["kwargs"]["lr"], m["optimizer"].pop("min_lr", 0.0)
            steps = get(tree, "grpo.max_num_steps")
            _set_inert(policy, "scheduler", schedule(m["scheduler"], lr, low, steps, problems), notes,
                       "megatron_cfg.scheduler")
    if "activation_checkpointing" in m:
        policy["activation_checkpointing"] = m.pop("activation_checkpointing")


def _train_iters(m: dict, problems: list[Problem], notes: list[Problem]) -> None:
    """Megatron decays the learning rate over train_iters when scheduler.lr_decay_iters is null; with it set,
    train_iters is only Megatron's iteration budget, and NeMo RL's loop (grpo.max_num_steps) ends the run."""
    if "train_iters" not in m:
        return
    m.pop("train_iters")
    if (m.get("scheduler") or {}).get("lr_decay_iters") is None:
        problems.append((f"{M}.train_iters", "Flywheel cannot honour it as the decay horizon: with "
                         "scheduler.lr_decay_iters null the schedule decays over grpo.max_num_steps; set lr_decay_iters"))
    else:
        notes.append((f"{M}.train_iters", "accepted, no effect: Megatron's iteration budget; the schedule decays "
                                          "over scheduler.lr_decay_iters and grpo.max_num_steps ends the run"))


def _inert_dtensor(policy: dict, problems: list[Problem], notes: list[Problem]) -> None:
    dtensor = policy.pop("dtensor_cfg", None)
    if isinstance(dtensor, dict) and dtensor.get("enabled", True):
        problems.append(("policy.dtensor_cfg.enabled", "true with megatron_cfg.enabled true: NeMo RL runs one "
                                                       "training backend; set one of them false"))
    elif dtensor is not None:
        notes.append(("policy.dtensor_cfg", "accepted, no effect: inert while megatron_cfg.enabled is true, as in "
                                            "NeMo RL"))


def _set_inert(policy: dict, key: str, value: Any, notes: list[Problem], source: str) -> None:
    """policy.<key> := value (from megatron_cfg), noting the DTensor value NeMo RL's Megatron path leaves unread."""
    if policy.get(key) is not None and policy[key] != value:
        notes.append((f"policy.{key}", f"accepted, no effect: NeMo RL's Megatron path reads {source} instead"))
    policy[key] = value
