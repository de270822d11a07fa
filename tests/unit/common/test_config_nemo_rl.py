"""NeMo RL's own grpo_math_1B.yaml (and grpo_math_8B.yaml, which inherits it) load with the few
edits docs/nemo_rl_mapping.md lists; each edit is needed, and nothing else is."""

import re
from pathlib import Path

import pytest

from services.common.config import ConfigError, load, load_config

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests/fixtures/nemo_rl/examples/configs"
EDITS = ["policy.generation.colocated.enabled=false"]
"""The documented differences (docs/nemo_rl_mapping.md, "Edits a NeMo RL config needs")."""


def _documented_edits() -> list[str]:
    doc = (ROOT / "docs/nemo_rl_mapping.md").read_text()
    section = doc.split("## Edits a NeMo RL config needs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


def test_grpo_math_1b_loads_with_at_most_five_documented_edits():
    assert len(EDITS) <= 5 and _documented_edits() == EDITS
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", EDITS)
    assert cfg.policy.model_name == "Qwen/Qwen2.5-1.5B" and cfg.grpo.num_prompts_per_step == 32
    assert cfg.grpo.max_staleness == 0  # async_grpo.enabled: false is synchronous GRPO, as in NeMo RL
    assert (cfg.grpo.max_num_epochs, cfg.grpo.val_period, cfg.grpo.max_val_samples) == (1, 10, 256)
    assert cfg.data.train.dataset_name == "OpenMathInstruct-2" and cfg.data.train.env_name == "math"
    assert cfg.data.train.prompt_file == "examples/prompts/cot.txt" and cfg.environments == []
    assert cfg.grpo.reward_shaping.max_response_length == 512  # ${policy.max_total_sequence_length}
    assert cfg.run.seed == 42 and cfg.env.math.num_workers == 8


@pytest.mark.parametrize("edit", EDITS)
def test_each_edit_is_needed_and_its_key_is_named(edit):
    key = edit.split("=")[0].lstrip("+")
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "grpo_math_1B.yaml", [e for e in EDITS if e != edit])
    assert [line for line in str(err.value).splitlines()] == [
        line for line in str(err.value).splitlines() if f": {key}: " in line] != []


def test_the_8b_config_inherits_the_1b_through_defaults():
    cfg = load_config(CONFIGS / "grpo_math_8B.yaml", EDITS)
    assert cfg.grpo.num_prompts_per_step == 64 and cfg.policy.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.policy.generation.max_new_tokens == 4096  # the parent's ${policy.max_total_sequence_length}, child's value
    assert cfg.data.train.dataset_name == "OpenMathInstruct-2"  # only in the parent


def test_keys_accepted_without_effect_are_reported_not_dropped_silently():
    _, notes = load(CONFIGS / "grpo_math_1B.yaml", EDITS)
    keys = {key for key, _ in notes}
    assert {"cluster", "policy.dtensor_cfg._v2", "policy.megatron_cfg.*"} <= keys
    assert all(why.startswith("accepted, no effect: ") for _, why in notes)


@pytest.mark.parametrize("override, key", [
    ("grpo.batch_multiplier=2", "grpo.batch_multiplier"),
    ("policy.generation.val_temperature=0.5", "policy.generation.val_temperature"),
    ("loss_fn.use_kl_in_reward=true", "loss_fn.use_kl_in_reward"),
])
def test_a_nemo_rl_key_flywheel_cannot_honour_is_refused_with_its_reason(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, override])
    lines = [line for line in str(err.value).splitlines() if f": {key}: " in line]
    assert len(lines) == 1 and ("cannot honour" in lines[0] or "not built" in lines[0]), str(err.value)


def test_async_grpo_enabled_takes_max_trajectory_age_steps_as_k():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.async_grpo.enabled=true",
                                                      "grpo.async_grpo.max_trajectory_age_steps=2"])
    assert cfg.grpo.max_staleness == 2


def test_use_cispo_is_taken_from_the_nemo_rl_config():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "loss_fn.use_cispo=true", "loss_fn.ratio_clip_min=1.0",
                                                      "loss_fn.ratio_clip_max=0.28"])
    assert cfg.loss_fn.use_cispo and (cfg.loss_fn.ratio_clip_min, cfg.loss_fn.ratio_clip_max) == (1.0, 0.28)


def test_a_dapo_recipes_reward_scaling_and_batch_multiplier_are_taken():
    """As NeMo RL's dapo-qwen2.5-7b recipe sets them: batch_multiplier is over-generation for dynamic sampling,
    which the controller's refills replace; above 1 without dynamic sampling it is refused (line above)."""
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=3",
                                                      "grpo.reward_scaling.enabled=true",
                                                      "grpo.reward_scaling.target_min=-1.0"])
    assert cfg.grpo.reward_scaling.enabled and cfg.grpo.reward_scaling.target_min == -1.0


def test_a_transfer_queue_recipe_and_smoke_s_negative_val_period_load():
    """As NeMo RL's *-tq_simple recipes and grpo_smoke.yaml set them."""
    cfg, notes = load(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "++data_plane={enabled: true, impl: transfer_queue}",
                                                      "grpo.val_period=-1"])
    assert cfg.grpo.val_period == -1 and any(key == "data_plane" for key, _ in notes)


def test_prorl_v2_loads_with_reinforce_plus_plus_and_its_dapo_parts():
    """NeMo RL's prorlv2.v2.yaml (on grpo_math_1B) with the same one edit: Reinforce++, dynamic sampling with
    over-generation, the stop-properly penalty, ICE-POP and decoupled clipping all taken as written."""
    cfg = load_config(CONFIGS / "prorlv2.v2.yaml", EDITS)
    g, loss = cfg.grpo, cfg.loss_fn
    assert (g.adv_estimator.name, g.adv_estimator.minus_baseline) == ("reinforce_plus_plus", True)
    assert g.use_dynamic_sampling and g.reward_shaping.stop_properly_penalty_coef == 0.0
    assert (loss.truncated_importance_sampling_type, loss.ratio_clip_max, loss.reference_policy_kl_type) == (
        "icepop", 0.27, "k2")
    assert g.use_leave_one_out_baseline and not g.adv_estimator.use_leave_one_out_baseline  # Reinforce++ reads neither


def test_an_estimator_flywheel_lacks_is_named():
    with pytest.raises(ConfigError, match=r"grpo.adv_estimator.name: .*'grpo', 'gdpo' or 'reinforce_plus_plus'.*opd"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.adv_estimator.name=opd"])


def test_the_estimators_own_baseline_settings_win_over_grpos_as_in_nemo_rl():
    """NeMo RL's estimators read adv_estimator.*, which its YAML interpolates from grpo.* unless a config sets them."""
    inherited = load_config(CONFIGS / "grpo_math_1B.yaml", EDITS).grpo.adv_estimator
    assert (inherited.normalize_rewards, inherited.use_leave_one_out_baseline) == (True, True)
    own = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.adv_estimator.use_leave_one_out_baseline=false"])
    assert own.grpo.use_leave_one_out_baseline and not own.grpo.adv_estimator.use_leave_one_out_baseline
    assert not load_config(None, ["grpo.normalize_rewards=false"]).grpo.adv_estimator.normalize_rewards


def test_a_deepscaler_recipes_dtensor_cfg_and_aime_repeat_are_taken():
    """As NeMo RL's grpo-gspo-deepscaler-1.5b-8K and grpo-nano-v2-12b recipes write them: cpu_offload becomes FSDP2's
    CPUOffloadPolicy, sequence_parallel does nothing at TP = 1 (NeMo RL applies it only inside a TP plan), and
    force_hf asks for the Hugging Face model class the trainer always uses."""
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [
        *EDITS, "policy.dtensor_cfg.cpu_offload=true", "policy.dtensor_cfg.sequence_parallel=true",
        "policy.dtensor_cfg.activation_checkpointing=true", "++policy.dtensor_cfg.automodel_kwargs={force_hf: true}",
        "++data.validation={dataset_name: AIME2024, repeat: 16}"])
    assert cfg.policy.cpu_offload and cfg.policy.activation_checkpointing
    assert cfg.data.validation.repeat == 16


@pytest.mark.parametrize("overrides, key", [
    (["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.sequence_parallel=true"], "sequence_parallel"),
    (["++policy.dtensor_cfg.automodel_kwargs={force_hf: false}"], "automodel_kwargs.force_hf"),
    (["++policy.dtensor_cfg.automodel_kwargs={backend: {attn: te, fake_balanced_gate: true}}"],
     "automodel_kwargs.backend"),
    (["++policy.dtensor_cfg.automodel_kwargs={backend: {attn: te, gate_precision: float64}}"],
     "automodel_kwargs.backend"),
    (["++policy.dtensor_cfg.automodel_kwargs={freeze_config: {freeze_language_model: true}}"],
     "automodel_kwargs.freeze_config"),
    (["++policy.dtensor_cfg.automodel_kwargs={attn_implementation: eager}"], "automodel_kwargs.attn_implementation"),
    (["policy.dtensor_cfg.enabled=false"], "enabled")])
def test_dtensor_settings_the_trainer_lacks_are_refused_by_their_own_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, *overrides])
    assert str(err.value).splitlines() == [line for line in str(err.value).splitlines()
                                           if f"policy.dtensor_cfg.{key}: Flywheel cannot honour" in line] != []


def test_automodels_tower_freezing_and_kernel_choices_are_taken_as_the_gemma4_recipes_write_them():
    """NeMo RL's dapo-gemma4-*-automodel recipes: the towers frozen (no effect on text: test_multimodal_checkpoint.py),
    Liger's kernels, no SDPA patching."""
    kwargs = ("{use_liger_kernel: true, use_sdpa_patching: false, freeze_config: {freeze_vision_tower: true, "
              "freeze_audio_tower: true, freeze_language_model: false}}")
    load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, f"++policy.dtensor_cfg.automodel_kwargs={kwargs}"])


def test_dtensor_expert_parallelism_and_automodels_kernels_are_taken_as_the_moe_recipes_write_them():
    """NeMo RL's *-automodel-ep* recipes: expert_parallel_size moves to the FSDP2 trainer's own key; Automodel's
    BackendConfig names kernels (Transformer Engine, grouped GEMM, DeepEP), which the Hugging Face classes replace."""
    backend = ("{_target_: nemo_automodel.components.models.common.utils.BackendConfig, attn: te, linear: te, "
               "rms_norm: torch_fp32, experts: torch_mm, enable_deepep: true, rope_fusion: false, "
               "enable_hf_state_dict_adapter: true}")
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "++policy.dtensor_cfg.expert_parallel_size=8",
                                                      f"++policy.dtensor_cfg.automodel_kwargs={{backend: {backend}}}"])
    assert cfg.policy.expert_parallel_size == 8


def test_dtensor_context_parallelism_is_taken_without_sequence_packing_as_the_dapo_recipes_run_it():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "policy.dtensor_cfg.context_parallel_size=2",
                                                      "policy.sequence_packing.enabled=false"])
    assert cfg.policy.context_parallel_size == 2
    with pytest.raises(ConfigError, match="context_parallel_size > 1 is the FSDP2 backend's, without .*sequence_pack"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "policy.dtensor_cfg.context_parallel_size=2"])


def test_dtensor_tensor_parallelism_is_taken_and_its_padding_is_accepted():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "policy.dtensor_cfg.tensor_parallel_size=4",
                                                      "policy.make_sequence_length_divisible_by=4"])
    assert cfg.policy.tensor_parallel_size == 4


def test_cpu_offload_is_refused_with_megatron():
    with pytest.raises(ConfigError, match="cpu_offload is the FSDP2 backend's"):
        load_config(None, ["policy.cpu_offload=true", "policy.megatron_cfg.enabled=true"])


def test_max_input_seq_length_is_taken_and_defaults_to_the_total_length():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "data.max_input_seq_length=256"])
    assert cfg.data.max_input_seq_length == 256
    assert load_config(CONFIGS / "grpo_math_1B.yaml", EDITS).data.max_input_seq_length == 512  # ${policy.max_total...}


def test_gdpo_math_1b_loads_with_its_multi_reward_environment():
    """NeMo RL's GDPO example: gsm8k scored by math_multi_reward's three components, the estimator's own
    use_leave_one_out_baseline (false) over grpo's inherited true."""
    cfg = load_config(CONFIGS / "gdpo_math_1B.yaml", EDITS)
    e = cfg.grpo.adv_estimator
    assert (e.name, e.normalize_rewards, e.use_leave_one_out_baseline, e.reward_weights) == ("gdpo", True, False, None)
    assert cfg.data.train.dataset_name == "gsm8k" and cfg.data.train.env_name == "math_multi_reward"
    assert cfg.env.math_multi_reward.num_workers == 8 and cfg.policy.max_total_sequence_length == 1024


def test_a_lora_recipes_lora_cfg_is_taken_with_automodels_defaults():
    """As NeMo RL's grpo-qwen3-8B-base-1n8g-fsdp2-lora recipe sets it on grpo_math_1B's lora_cfg (match_all_linear,
    Triton kernel): use_triton is a kernel choice, noted; the rest becomes policy.lora_cfg."""
    cfg, notes = load(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "policy.dtensor_cfg.lora_cfg.enabled=true",
                                                      "policy.dtensor_cfg.lora_cfg.dim=128",
                                                      "policy.dtensor_cfg.lora_cfg.alpha=128"])
    lora = cfg.policy.lora_cfg
    assert (lora.enabled, lora.dim, lora.alpha, lora.match_all_linear, lora.lora_A_init) == (True, 128, 128, True,
                                                                                              "xavier")
    assert any(key == "policy.lora_cfg.use_triton" for key, _ in notes)


@pytest.mark.parametrize("overrides, message", [
    (["policy.lora_cfg.enabled=true", "policy.megatron_cfg.enabled=true"], "Megatron-Core LoRA is not built"),
    (["policy.lora_cfg.target_modules=[q_proj]", "policy.lora_cfg.exclude_modules=[lm_head]"], "not both"),
    (["policy.lora_cfg.match_all_linear=true", "policy.lora_cfg.target_modules=[q_proj]"], "match_all_linear"),
    (["policy.lora_cfg.lora_A_init=gaussian"], "lora_A_init")])
def test_lora_settings_flywheel_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_sequence_logprob_error_threshold_is_taken_for_grpo_on_both_backends_and_refused_where_it_is_not_built():
    """As NeMo RL's Nemotron-3 recipes set it (2); Reinforce++/GDPO whiten over the step's samples after NeMo RL
    masks, and Flywheel's advantages come before the trainer's logprobs."""
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.seq_logprob_error_threshold=2"])
    assert cfg.grpo.seq_logprob_error_threshold == 2
    with pytest.raises(ConfigError, match="adv_estimator 'reinforce_plus_plus' is not built"):
        load_config(CONFIGS / "prorlv2.v2.yaml", [*EDITS, "grpo.seq_logprob_error_threshold=2"])
    megatron = load_config(CONFIGS / "grpo_math_1B_megatron.yaml", [*EDITS, "grpo.seq_logprob_error_threshold=2"])
    assert megatron.grpo.seq_logprob_error_threshold == 2  # the Megatron backend masks too (its forward: GPU only)


def test_an_early_stop_on_a_validation_metric_is_taken_with_nemo_rls_checks():
    stop = ["grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.8"]
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, *stop, "grpo.val_num_generations_per_prompt=4"])
    assert cfg.grpo.validation_key(cfg.grpo.stop_at_validation_metric) == "validation/pass@4"
    with pytest.raises(ConfigError, match="pass_k' needs val_num_generations_per_prompt > 1"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, *stop])
    with pytest.raises(ConfigError, match="set together"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.stop_at_validation_metric=accuracy"])
    with pytest.raises(ConfigError, match="Input should be 'accuracy', 'avg_length' or 'pass_k'"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "grpo.stop_at_validation_metric=reward",
                                                    "grpo.stop_at_validation_threshold=1"])
    accuracy = ["grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.5"]
    with pytest.raises(ConfigError, match="no validation is ever due"):
        load_config(None, accuracy)
    with pytest.raises(ConfigError, match="nothing to validate on"):
        load_config(None, [*accuracy, "grpo.val_period=2", "environments=[]", "data.train.data_path=x.jsonl"])


def test_the_reward_model_config_scores_with_its_reward_model():
    """grpo_rm_1B.yaml: data.default.env_name reward_model, and env.reward_model's settings for the server."""
    cfg, notes = load(CONFIGS / "grpo_rm_1B.yaml", EDITS)
    rm = cfg.env.reward_model
    assert cfg.uses_reward_model and [d.env_name for d in cfg.data.train_sets()] == ["reward_model"]
    assert (rm.model_name, rm.tokenizer.name, rm.precision, rm.batch_size, rm.max_model_len) == (
        "Skywork/Skywork-Reward-V2-Qwen3-0.6B", "Skywork/Skywork-Reward-V2-Qwen3-0.6B", "bfloat16",
        cfg.policy.train_micro_batch_size, 2048)
    assert {"env.reward_model.dtensor_cfg", "env.reward_model.resources"} <= {key for key, _ in notes}
    for edit, why in [("env.reward_model.checkpoint_path=/ckpt", "DCP checkpoints are not read"),
                      ("env.reward_model.dtensor_cfg.tensor_parallel_size=2", "no tensor or context parallelism"),
                      ("env.reward_model.reward_model_cfg.reward_model_type=other", "bradley_terry"),
                      ("env.reward_model.model_name=null", "needs a reward model"),
                      ("environments=[{name: rm, kind: reward_model}]", "generates none; give each a dataset")]:
        with pytest.raises(ConfigError, match=why):
            load_config(CONFIGS / "grpo_rm_1B.yaml", [*EDITS, edit])


def test_the_sliding_puzzle_config_runs_as_its_script_does():
    """NeMo RL's grpo_sliding_puzzle.yaml (run by run_grpo_sliding_puzzle.py): the game's settings, generated
    puzzles instead of grpo_math_1B's dataset, 50 turns, </action> ending the first turn as the later ones."""
    cfg, notes = load(CONFIGS / "grpo_sliding_puzzle.yaml", EDITS)
    assert [(e.name, e.kind, e.dataset, e.sampling.stop_strings) for e in cfg.environments] == [
        ("sliding_puzzle_game", "sliding_puzzle", "", ["</action>"])]
    assert (cfg.env.sliding_puzzle.size, cfg.env.sliding_puzzle.shuffle_moves, cfg.env.sliding_puzzle.max_moves) == (
        5, 10, 30)
    assert cfg.data.train is None and cfg.data.validation is None and cfg.grpo.max_rollout_turns == 50
    assert cfg.has_validation_prompts and cfg.grpo.val_period == 10  # on generated puzzles
    assert cfg.checkpointing.metric_name == "val:accuracy" and cfg.policy.model_name == "Qwen/Qwen2.5-1.5B-Instruct"
    keys = {key for key, _ in notes}
    assert {"env.sliding_puzzle_game", "data.train", "data.add_system_prompt"} <= keys
    with pytest.raises(ConfigError, match="env.sliding_puzzle.size"):
        load_config(CONFIGS / "grpo_sliding_puzzle.yaml", [*EDITS, "env.sliding_puzzle_game.cfg.game_config.size=1"])


def test_multiple_dataloader_settings_are_inert_while_use_multiple_dataloader_is_false():
    """NeMo RL's grpo_multiple_datasets.yaml sets them with use_multiple_dataloader: false, where NeMo RL reads
    neither; its two train datasets are concatenated (here: mixed in proportion to their sizes)."""
    extra = ["++data.num_prompts_per_dataloader=16", "++data.custom_dataloader=examples.custom_dataloader.f"]
    _, notes = load(CONFIGS / "grpo_math_1B.yaml", [*EDITS, *extra])
    assert {"data.num_prompts_per_dataloader", "data.custom_dataloader"} <= {key for key, _ in notes}
    with pytest.raises(ConfigError, match="data.use_multiple_dataloader"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, *extra, "data.use_multiple_dataloader=true"])


def test_nemo_rls_nixl_refit_is_the_nixl_weight_channel():
    """grpo_math_8B_megatron_nixl.yaml's transport; a weight_sync.backend set otherwise conflicts with it."""
    cfg = load_config(CONFIGS / "grpo_math_8B_megatron_nixl.yaml", EDITS)
    assert cfg.weight_sync.backend == "nixl"
    assert load_config(CONFIGS / "grpo_math_1B.yaml", EDITS).weight_sync.backend == "gloo"
    with pytest.raises(ConfigError, match="refit_transport: means weight_sync.backend, which is set to 'nccl'"):
        load_config(CONFIGS / "grpo_math_8B_megatron_nixl.yaml", [*EDITS, "++weight_sync.backend=nccl"])
    with pytest.raises(ConfigError, match="refit_cfg.nixl.backend_name: Flywheel cannot honour 'LIBFABRIC'"):
        load_config(CONFIGS / "grpo_math_8B_megatron_nixl.yaml",
                    [*EDITS, "policy.generation.refit_cfg.nixl.backend_name=LIBFABRIC"])


def test_worker_env_vars_go_to_the_service_that_runs_those_workers():
    cfg = load_config(CONFIGS / "grpo_math_1B.yaml", [
        *EDITS, "++policy.dtensor_cfg.env_vars.NCCL_DEBUG=WARN", "++policy.dtensor_cfg.env_vars.NCCL_NVLS_ENABLE=0",
        "++policy.generation.vllm_cfg.env_vars.VLLM_ATTENTION_BACKEND=TRITON_ATTN"])
    assert cfg.trainer.env_vars == {"NCCL_DEBUG": "WARN", "NCCL_NVLS_ENABLE": "0"}  # YAML's 0: its text
    assert cfg.rollout.env_vars == {"VLLM_ATTENTION_BACKEND": "TRITON_ATTN"}
    assert load_config(CONFIGS / "grpo_math_1B.yaml", EDITS).trainer.env_vars == {}  # NeMo RL's null: none


@pytest.mark.parametrize("override, message", [
    ("++policy.dtensor_cfg.env_vars.CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES is set by the launchers"),
    ("++policy.generation.vllm_cfg.env_vars.MASTER_PORT=1", "MASTER_PORT is set by the launchers"),
    ("++policy.dtensor_cfg.env_vars.NCCL_DEBUG=[WARN]", "NCCL_DEBUG: ['WARN'] is not a string or a number"),
])
def test_an_env_var_the_launchers_own_or_that_is_no_string_is_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, override])
