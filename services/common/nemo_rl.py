"""NeMo RL's config keys -> Flywheel's schema: what moves, what is accepted without effect, what is refused.

    composed tree ──moves (grpo.seed -> run.seed, ...)──▶ rules for keys the schema lacks ──▶ schema validation

A key the Flywheel schema has passes through unchanged (same name, same meaning). A NeMo RL key
it lacks is looked up in RULES: each rule accepts the key only at values that describe what
Flywheel does anyway (a feature switched off, a size of 1, a value equal to another key), and
then records a note saying why it has no effect; at any other value the key is refused with
the rule's reason. A key with no rule is unknown. So nothing is dropped silently: a note for
each accepted key (`flywheel config check` prints them), an error for each refused one.
docs/nemo_rl_mapping.md is the same table in prose.
"""

from __future__ import annotations

import copy
import fnmatch
import types
import typing
from typing import Any

from pydantic import BaseModel

from services.common import nemo_rl_async as async_rl
from services.common import nemo_rl_gym as gym
from services.common import nemo_rl_megatron as megatron
from services.common.config_loader import Problem
from services.common.config_distillation import DISTILLATION_RULES
from services.common.config_offline import OFFLINE_RULES
from services.common.nemo_rl_optim import fused_adam
from services.common.nemo_rl_rules import MISSING, Rule, any_, get, is_, off, same_as, when

def _automodel_backend(v: Any, _: dict) -> bool:
    """Automodel's BackendConfig (at NeMo RL's pin): kernel and dispatcher choices, unless it replaces the router,
    computes in FP8 or runs the router above float32."""
    v = v or {}
    return (not v.get("fake_balanced_gate") and v.get("te_fp8") is None
            and str(v.get("gate_precision")).removeprefix("torch.") in ("None", "float32"))


def _sequence_parallel(v: Any, tree: dict) -> bool:
    return not v or get(tree, "policy.tensor_parallel_size", 1) == 1  # moved out of dtensor_cfg before the rules run


NEMO_GYM = "NeMo Gym is off; with it on, env.nemo_gym becomes a nemo_gym agent environment (nemo_rl_gym.py)"
QUANT = "ModelOpt quantization (quantization-aware training, quantized rollouts) is not built"
READ_WITH = "read only with {}, which is refused on its own"
PLACEMENT = "process placement is the launcher's (rollout.num_workers, trainer.nproc_per_node, deploy/)"
VLLM_ONLY = "Flywheel's vLLM engine"
RULES: tuple[Rule, ...] = (
    Rule("grpo.batch_multiplier", lambda v, tree: v == 1 or (get(tree, "grpo.use_dynamic_sampling") and v >= 1),
         "over-generation for dynamic sampling: Flywheel's controller leases a new prompt for each group dynamic "
         "sampling drops, so a step fills without extra prompts up front; without use_dynamic_sampling it must be 1"),
    Rule("grpo.calculate_advantages_on_gpu", any_, "where the advantages are computed: speed, not their values"),
    Rule("grpo.invalid_tool_call_strategy", any_, "NeMo RL reads no such key (its swe1 recipe sets it); "
         "grpo.invalid_tool_call_advantage decides what a flagged turn gets"),
    Rule("policy.generation.vllm_cfg.enforce_monotonicity", any_, "NeMo RL reads no such key (its swe1 recipe sets it)"),
    Rule("policy.generation.vllm_cfg.enable_thinking", any_, "NeMo RL reads no such key: thinking is the chat "
         "template's enable_thinking (policy.tokenizer.chat_template_kwargs)"),
    Rule("grpo.penalize_invalid_tool_call", any_, "NeMo RL reads no such key: grpo.invalid_tool_call_advantage "
         "alone turns the override on"),
    Rule("grpo.penalize_malformed_thinking", any_, "NeMo RL reads no such key: grpo.malformed_thinking_advantage "
         "alone turns the override on"),
    Rule("grpo.skip_reference_policy_logprobs_calculation",
         lambda v, t: not v or get(t, "loss_fn.reference_policy_kl_penalty") == 0,
         "with loss_fn.reference_policy_kl_penalty 0 Flywheel computes no reference logprobs; above 0 it needs them"),
    Rule("grpo.val_batch_size", any_, "validation prompts go to rollout one request each; the engine batches"),
    Rule("grpo.async_grpo.max_generation_failures", lambda v, _: isinstance(v, int) and v >= 0,
         "the failures NeMo RL drops before it aborts: a failed generation is redelivered by the work queue (after "
         "ack_wait), never dropped, so there is nothing to count"),
    Rule("reward_penalties", lambda v, _: not any((v or {}).values()), "NeMo-Gym reward penalties are not built"),
    Rule("loss_fn.use_kl_in_reward", is_(False), "KL in the reward (Reinforce++) is not built"),
    Rule("loss_fn.positive_example_nll_weight", is_(0.0), "the VAPO NLL term is not built"),
    Rule("checkpointing.model_save_format", lambda v, _: v in ("safetensors", None),
         "checkpoints are DCP shards; `flywheel export` writes safetensors"),
    Rule("checkpointing.save_consolidated", is_(False), "`flywheel export` consolidates a checkpoint"),
    Rule("checkpointing.save_optimizer", is_(True), "the optimizer state is always saved"),
    Rule("policy.tokenizer.use_fastokens", is_(False), "the fastokens tokenizer is not built"),
    Rule("policy.generation_batch_size", any_, "rollout batches a group's samples itself"),
    Rule("policy.dtensor_cfg.enabled", is_(True), "the trainer is FSDP2 (NeMo RL's DTensor path) unless "
         "megatron_cfg.enabled is true"),
    Rule("policy.dtensor_cfg._v2", any_, "NeMo RL's two DTensor workers (_v2 true: Automodel's; false: the first) both "
         "shard the Hugging Face model with FSDP2, as the FSDP2 trainer does"),
    Rule("policy.dtensor_cfg.sequence_parallel", _sequence_parallel, "the FSDP2 trainer's tensor parallelism (the "
         "model's own TP plan) has no sequence parallelism; at tensor_parallel_size 1 NeMo RL applies none either"),
    Rule("policy.dtensor_cfg.custom_parallel_plan", is_(None), "custom TP plans are not built: the trainer uses "
         "the model's own Hugging Face TP plan"),
    Rule("policy.dtensor_cfg.automodel_kwargs.force_hf", is_(True), "the trainer loads the Hugging Face model class; "
         "Automodel's own model implementations are not built"),
    Rule("policy.dtensor_cfg.automodel_kwargs.backend", _automodel_backend, "Automodel's own model implementations "
         "and their kernels (Transformer Engine attention, linear and norm, grouped-GEMM experts, DeepEP dispatch): the "
         "trainer runs the Hugging Face classes, which compute the same model, and transformers' expert dispatch with "
         "expert_parallel_size > 1; what changes the model is refused: fake_balanced_gate (routing replaced), te_fp8, "
         "a gate_precision above float32 (the Hugging Face routers' own)"),
    Rule("policy.dtensor_cfg.automodel_kwargs.use_liger_kernel", any_, "Liger's fused kernels compute what the "
         "Hugging Face modules the trainer runs compute: speed, not the math"),
    Rule("policy.dtensor_cfg.automodel_kwargs.attn_implementation", is_(None), "the trainer loads the model with "
         "transformers' default attention implementation; choosing another is not wired"),
    Rule("policy.dtensor_cfg.automodel_kwargs.use_sdpa_patching", is_(False), "Automodel's SDPA patching is not built"),
    Rule("policy.dtensor_cfg.automodel_kwargs.freeze_config", lambda v, _: not (v or {}).get("freeze_language_model"),
         "Flywheel trains on text, so a multimodal model's vision and audio towers and their projectors (what "
         "Automodel freezes) take no input and get no gradient, frozen or not "
         "(tests/unit/trainer/test_multimodal_checkpoint.py); freezing the language model is not built"),
    Rule("policy.dtensor_cfg.moe_parallelizer", any_, "Automodel's MoE parallelizer options; the trainer shards "
         "the Hugging Face MoE layers as they are"),
    Rule("policy.dtensor_cfg.clear_cache_every_n_steps", any_, "emptying the CUDA cache: memory, not the math"),
    Rule("policy.lora_cfg.use_triton", any_, "a kernel choice (Triton or not); the LoRA math is the same"),
    Rule("policy.draft", off, "draft-model (speculative) training is not built"),
    Rule("policy.sequence_packing.*", any_, "packing order and rounding change speed, not the loss"),
    Rule("policy.dynamic_batching.sequence_length_round", any_, "rounding changes speed, not the loss"),
    Rule("policy.make_sequence_length_divisible_by", any_, "padding for sequence parallelism, which is not built; "
         "tensor parallelism without it splits no sequence, and the trainer pads to its own widths"),
    Rule("policy.generation.port_range_low", any_, PLACEMENT),
    Rule("policy.generation.port_range_high", any_, PLACEMENT),
    Rule("policy.generation.val_temperature", same_as("policy.generation.temperature"),
         "validation samples with the training temperature"),
    Rule("policy.generation.val_top_p", same_as("policy.generation.top_p"), "validation samples with the training top_p"),
    Rule("policy.generation.val_top_k", same_as("policy.generation.top_k"), "validation samples with the training top_k"),
    Rule("policy.generation.refit_transport", lambda v, _: v in (None, "nixl"), "the weight transport is "
         "weight_sync.backend: gloo, nccl, nixl (NeMo RL's nixl refit) or filesystem"),
    Rule("policy.generation.real_quant_export_cpu_offload", any_, "quantized export is not built"),
    Rule("policy.generation.refit_cfg.nixl.update_weights_bucket_memory_ratio", any_, "buckets are weight_sync.bucket_size_mb"),
    Rule("policy.generation.refit_cfg.nixl.device", any_, "the trainer's buckets live where its weights are"),
    Rule("policy.generation.refit_cfg.nixl.backend_name", is_("UCX"), "Flywheel's NIXL agent uses UCX"),
    Rule("policy.generation.refit_cfg.nixl.backend_init_params", is_(None), "Flywheel's NIXL agent uses UCX with its defaults"),
    Rule("policy.generation.refit_cfg.nixl.release_after_refit", is_(False), "the trainer keeps its registered buckets between syncs"),
    Rule("policy.generation.refit_cfg.nixl.shard_expert_weights", is_(False), "expert sharding is not built"),
    Rule("policy.generation.refit_cfg.sparse", any_, READ_WITH.format("refit_transport vllm_zmq_sparse")),
    Rule("policy.generation.mcore_generation_config", lambda v, t: get(t, "policy.generation.backend") != "megatron",
         "Megatron generation is not built"),
    Rule("policy.generation.colocated.enabled", is_(False), "colocated generation is not built: rollout is its own "
         "service on its own devices (NeMo RL's non-colocated mode); set policy.generation.colocated.enabled=false"),
    Rule("policy.generation.colocated.resources", any_, PLACEMENT),
    Rule("policy.generation.vllm_cfg.async_engine", any_, f"{VLLM_ONLY} serves each rollout worker's requests"),
    Rule("policy.generation.vllm_cfg.precision", same_as("policy.precision"), "vLLM runs at policy.precision"),
    Rule("policy.generation.vllm_cfg.kv_cache_dtype", is_("auto"), "the KV cache takes the model's dtype"),
    Rule("policy.generation.vllm_cfg.logprobs_mode", is_("processed_logprobs"),
         f"{VLLM_ONLY} returns processed logprobs (after temperature), as NeMo RL's default"),
    Rule("policy.generation.vllm_cfg.pipeline_parallel_size", is_(1), "vLLM pipeline parallelism is not wired"),
    Rule("policy.generation.vllm_cfg.enable_expert_parallel", any_,
         "NeMo RL's vLLM worker derives it from expert_parallel_size > 1, as rollout does"),
    Rule("policy.generation.vllm_cfg.max_model_len", same_as("policy.max_total_sequence_length"),
         "vLLM's context is policy.max_total_sequence_length"),
    Rule("policy.generation.vllm_cfg.use_tqdm", any_, "progress bars only"),
    Rule("policy.generation.vllm_cfg.distributed_executor_backend", is_(None), "vLLM picks its executor (NeMo RL's "
         "null); to choose one, set policy.generation.vllm_kwargs.distributed_executor_backend"),
    Rule("policy.generation.vllm_cfg.enable_prefix_caching", any_,
         f"{VLLM_ONLY} caches prefixes always; a cache changes speed, not the samples"),
    Rule("policy.generation.vllm_cfg.skip_tokenizer_init", is_(False), "rollout's engine keeps its tokenizer: the "
         "endpoint renders chat templates and decodes with it"),
    Rule("policy.generation.vllm_cfg.http_server_serving_chat_kwargs.enable_auto_tools", is_(True), "the endpoint "
         "reads tool calls whenever a request offers tools and tool_choice is not none (vLLM's auto tool choice)"),
    Rule("policy.generation.vllm_cfg.reasoning_parser_plugin", is_(None), "a reasoning parser loaded from user "
         "code is not wired; policy.generation.reasoning_parser names vLLM's own"),
    Rule("policy.generation.vllm_cfg.use_deep_gemm", is_(False), "DeepGEMM is not wired"),
    Rule("policy.generation.vllm_cfg.num_last_layers_in_bf16", is_(0), "mixed-precision layers are not wired"),
    Rule("policy.generation.vllm_cfg.num_first_layers_in_bf16", is_(0), "mixed-precision layers are not wired"),
    Rule("policy.generation.vllm_cfg.enable_vllm_metrics_logger", any_, "rollout serves Prometheus /metrics instead"),
    Rule("policy.generation.vllm_cfg.vllm_metrics_logger_interval", any_, "rollout serves Prometheus /metrics instead"),
    Rule("policy.generation.vllm_cfg.http_refit_api_key_env_var", is_(None), "HTTP refit is not built"),
    Rule("policy.generation.vllm_cfg.http_refit_server_port", is_(None), "HTTP refit is not built"),
    Rule("policy.generation.vllm_cfg.zmq_refit_server_port", is_(None), "ZMQ refit is not built"),
    Rule("policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update", is_(False), "multimodal is not built"),
    Rule("data.num_workers", any_, "the controller reads rows itself; no loader workers"),
    Rule("env.reward_model.processor", any_, "the prompts are shaped by the datasets' own processor (data.*)"),
    Rule("env.reward_model.checkpoint_path", is_(None),
         "the reward model loads from model_name (a Hugging Face id or directory); DCP checkpoints are not read"),
    Rule("env.reward_model.offload_optimizer_for_logprob", any_, "the reward model only scores: no optimizer"),
    Rule("env.reward_model.max_grad_norm", any_, "the reward model only scores: no gradients"),
    Rule("env.reward_model.resources", any_,
         "the reward-model server is one process (flywheel serve reward_model), on one GPU where CUDA is present"),
    Rule("env.reward_model.dtensor_cfg", lambda v, _: (v or {}).get("tensor_parallel_size", 1) == 1
         and (v or {}).get("context_parallel_size", 1) == 1 and not (v or {}).get("cpu_offload"),
         "the reward model runs whole in one process: no tensor or context parallelism, no offload"),
    Rule("env.reward_model.dynamic_batching", off, "the server scores env.reward_model.batch_size conversations at once"),
    Rule("env.reward_model.sequence_packing", off, "the server scores env.reward_model.batch_size conversations at once"),
    Rule("data.add_system_prompt", is_(False), "a variable NeMo RL's sliding-puzzle script hands the chat template; "
         "unset, a template reads it as false (set policy.tokenizer.chat_template_kwargs for a template that reads it)"),
    Rule("data.use_multiple_dataloader", is_(False), "multiple dataloaders are not built; use the environments mix"),
    Rule("data.num_prompts_per_dataloader", when("data.use_multiple_dataloader", False),
         "inert while use_multiple_dataloader is false, as in NeMo RL"),
    Rule("data.custom_dataloader", when("data.use_multiple_dataloader", False),
         "inert while use_multiple_dataloader is false, as in NeMo RL"),
    Rule("logger.tensorboard_enabled", any_, "TensorBoard events are always written (<run_dir>/<log_dir>/tensorboard)"),
    Rule("logger.tensorboard", any_, "TensorBoard events are always written (<run_dir>/<log_dir>/tensorboard)"),
    Rule("logger.monitor_gpus", any_, "GPU use is on each service's Prometheus /metrics"),
    Rule("logger.gpu_monitoring", any_, "GPU use is on each service's Prometheus /metrics"),
    Rule("logger.swanlab_enabled", is_(False), "SwanLab is not wired"),
    Rule("logger.swanlab", when("logger.swanlab_enabled", False), "SwanLab is not wired"),
    Rule("logger.wandb.log_nemo_gym_full_result_tables", is_(False), "NeMo-Gym tables are not built"),
    Rule("env.should_use_nemo_gym", is_(False), NEMO_GYM),
    Rule("env.nemo_gym", any_, "read only with env.should_use_nemo_gym true"),
    Rule("env.should_mask_flagged_samples", any_, "NeMo Gym 0.4 (the version the NeMo Gym venv installs) flags no "
         "sample (its responses carry no mask_sample), so there is nothing to mask"),
    Rule("env.should_log_nemo_gym_responses", any_, "NeMo RL's per-step jsonl of NeMo Gym's responses: a log, not "
         "the update"),
    Rule("policy.router_replay", off, "MoE router replay is not built"),
    Rule("policy.quant_cfg", is_(None), QUANT),
    Rule("policy.generation.quant_cfg", is_(None), QUANT),
    Rule("policy.generation.real_quant", lambda v, _: not v, QUANT),
    *(Rule(k, any_, READ_WITH.format("quantization")) for k in (
        "policy.quant_*", "policy.disable_modelopt_layer_spec", "policy.generation.real_quant_ignore",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws")),
    Rule("cluster", any_, PLACEMENT),
    Rule("data_plane", any_, "NeMo RL's TransferQueue data plane moves batches between its driver and workers; "
         "Flywheel's replay (Redis) and gRPC do that job whatever it says"),
    Rule("on_policy_distillation", is_(None), "GRPO with a teacher's logprob gap as the advantage (NeMo RL's MOPD, "
         "adv_estimator opd) is not built; distillation by the KL to a teacher's top-k is a run with a distillation: "
         "section (distillation_math.yaml)"),
)

MOVES = {"grpo.seed": "run.seed", "policy.dtensor_cfg.activation_checkpointing": "policy.activation_checkpointing",
         "policy.dtensor_cfg.cpu_offload": "policy.cpu_offload",
         "policy.dtensor_cfg.tensor_parallel_size": "policy.tensor_parallel_size",
         "policy.dtensor_cfg.expert_parallel_size": "policy.expert_parallel_size",
         "policy.dtensor_cfg.context_parallel_size": "policy.context_parallel_size",
         "policy.dtensor_cfg.lora_cfg": "policy.lora_cfg",
         "policy.dtensor_cfg.env_vars": "trainer.env_vars",
         "policy.generation.vllm_cfg.env_vars": "rollout.env_vars",
         "policy.generation.vllm_cfg.expose_http_server": "policy.generation.endpoint.enabled",
         "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser": "policy.generation.tool_parser",
         "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser":
             "policy.generation.reasoning_parser",
         "env.sliding_puzzle_game.cfg.game_config.size": "env.sliding_puzzle.size",
         "env.sliding_puzzle_game.cfg.game_config.shuffle_moves": "env.sliding_puzzle.shuffle_moves",
         "env.sliding_puzzle_game.cfg.max_moves": "env.sliding_puzzle.max_moves"}
"""NeMo RL key -> the Flywheel key with the same meaning."""

SLIDING_PUZZLE_GAME = "sliding_puzzle_game"
"""The task NeMo RL's run_grpo_sliding_puzzle.py trains: the environment of that name, on puzzles it generates."""


def translate(tree: dict, schema: type[BaseModel]) -> tuple[dict, list[Problem], list[Problem]]:
    """(tree in Flywheel's schema, problems, notes). `tree` is a resolved plain dict; it is not changed."""
    out = copy.deepcopy(tree)
    problems: list[Problem] = []
    notes: list[Problem] = []
    game = get(out, f"env.{SLIDING_PUZZLE_GAME}") is not None
    megatron.prepare(out, problems, notes)
    gym.prepare(out, problems, notes)
    async_rl.prepare(out, problems, notes)
    if get(out, "policy.generation.refit_transport") == "nixl":  # NeMo RL's NIXL refit is Flywheel's nixl channel
        _move(out, "policy.generation.refit_transport", "weight_sync.backend", problems)
    if megatron.enabled(out):  # the workers of the backend that trains: Megatron's, else DTensor's (MOVES)
        _move(out, "policy.megatron_cfg.env_vars", "trainer.env_vars", problems)
    fused_adam(get(out, "policy.optimizer"), problems, notes)
    _server_template(out, problems, notes)
    for src, dst in MOVES.items():
        _move(out, src, dst, problems)
    if game:
        _as_sliding_puzzle_script(out, notes)
    if get(out, "policy.generation.stop_strings", []) is None:  # NeMo RL's "none" is Flywheel's empty list
        out["policy"]["generation"]["stop_strings"] = []
    rules = RULES + async_rl.RULES + OFFLINE_RULES + DISTILLATION_RULES + (megatron.RULES if megatron.enabled(out) else megatron.INERT)
    _walk(out, copy.deepcopy(out), "", schema, rules, problems, notes)  # rules read the tree as written
    return out, problems, notes


def _as_sliding_puzzle_script(tree: dict, notes: list[Problem]) -> None:
    """env.sliding_puzzle_game is NeMo RL's sliding-puzzle example, which its own script runs: the game on puzzles it
    generates, for training and validation, with no dataset read (data.* comes from grpo_math_1B's defaults)."""
    env = tree["env"]
    if not _prune(env[SLIDING_PUZZLE_GAME]):
        del env[SLIDING_PUZZLE_GAME]  # all moved to env.sliding_puzzle; anything left is reported unknown
    spec = {"name": SLIDING_PUZZLE_GAME, "kind": "sliding_puzzle", "sampling": {"stop_strings": ["</action>"]}}
    tree["environments"] = [*(tree.get("environments") or []), spec]
    why = (f"read as NeMo RL's sliding-puzzle example: the environment {SLIDING_PUZZLE_GAME} (kind sliding_puzzle) "
           "trains and validates on puzzles it generates, as run_grpo_sliding_puzzle.py does")
    notes.append((f"env.{SLIDING_PUZZLE_GAME}", why))
    data = tree.get("data") or {}
    for key in ("train", "validation"):
        if data.get(key) is not None:
            data[key] = None
            notes.append((f"data.{key}", "accepted, no effect: run_grpo_sliding_puzzle.py reads no dataset"))


def _prune(node: dict) -> dict:
    """`node` without the dicts under it that hold nothing but empty dicts."""
    for key in list(node):
        if isinstance(node[key], dict) and not _prune(node[key]):
            del node[key]
    return node


SERVING = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"


def _server_template(tree: dict, problems: list[Problem], notes: list[Problem]) -> None:
    """vLLM's server-wide chat template and its kwargs are policy.tokenizer's, which the endpoint renders with (a
    request's own kwargs win, as over vLLM's defaults); they then also apply to the prompts rendered from data."""
    serving = get(tree, SERVING)
    if not isinstance(serving, dict):
        return
    tokenizer = tree.setdefault("policy", {}).setdefault("tokenizer", {})
    template = serving.pop("chat_template", None)
    if template is not None:
        if tokenizer.get("chat_template", "default") not in ("default", template):
            problems.append((f"{SERVING}.chat_template", "differs from policy.tokenizer.chat_template, which the "
                                                         "endpoint renders with; set one"))
        else:
            tokenizer["chat_template"] = template
            notes.append((f"{SERVING}.chat_template", "read as policy.tokenizer.chat_template, which the endpoint "
                                                      "renders with; it renders prompts from data too"))
    value = serving.pop("default_chat_template_kwargs", None)
    if value is None:
        return
    current = tokenizer.get("chat_template_kwargs") or {}
    key = f"{SERVING}.default_chat_template_kwargs"
    clash = {k for k in set(current) & set(value) if current[k] != value[k]}
    if clash:
        problems.append((key, f"sets {sorted(clash)} otherwise than policy.tokenizer.chat_template_kwargs, which "
                              f"the endpoint renders with; set one"))
        return
    tokenizer["chat_template_kwargs"] = {**current, **value}
    notes.append((key, "read into policy.tokenizer.chat_template_kwargs, which the endpoint renders with; they "
                       "apply to prompts rendered from data too"))


def _move(tree: dict, src: str, dst: str, problems: list[Problem]) -> None:
    value = get(tree, src, MISSING)
    if value is MISSING:
        return
    *parents, leaf = src.split(".")
    del get(tree, ".".join(parents))[leaf]
    current = get(tree, dst, MISSING)
    if current is not MISSING and current != value:
        problems.append((src, f"means {dst}, which is set to {current!r}; set one of them"))
        return
    node = tree
    *parents, leaf = dst.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _walk(node: dict, root: dict, prefix: str, model: type[BaseModel] | None, rules, problems, notes) -> None:
    for key in list(node):
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key) if model is not None else None
        if field is not None:
            sub = _section(field.annotation)
            if sub is not None and isinstance(node[key], dict):
                _walk(node[key], root, f"{dotted}.", sub, rules, problems, notes)
            continue
        rule = next((r for r in rules if fnmatch.fnmatchcase(dotted, r.pattern.replace("*", "[!.]*"))), None)
        if rule is None:
            if isinstance(node[key], dict) and any(r.pattern.startswith(f"{dotted}.") for r in rules):
                _walk(node[key], root, f"{dotted}.", None, rules, problems, notes)
                if not node[key]:
                    del node[key]  # every key below was a rule's
            continue  # else the schema names it unknown, with the others
        value = node.pop(key)
        if rule.accept(value, root):
            where = rule.pattern if "*" in rule.pattern else dotted  # one note per wildcard rule, not per key
            if all(noted != where for noted, _ in notes):
                notes.append((where, f"accepted, no effect: {rule.why}"))
        else:
            problems.append((dotted, f"Flywheel cannot honour {_short(value)}: {rule.why}"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _section(annotation: Any) -> type[BaseModel] | None:
    """The Section model inside `annotation` (X, X | None), or None for leaves, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None
