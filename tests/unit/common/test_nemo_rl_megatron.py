"""NeMo RL's megatron_cfg (grpo_math_1B_megatron.yaml and the keys its recipes set) and fused Adam names, taken
onto the keys Flywheel's trainers read; the schedule is checked against Megatron-Core's own scheduler."""

from pathlib import Path

import pytest
from needs import require_module

from services.common.config import ConfigError, load, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures/nemo_rl/examples/configs"
MEGATRON = CONFIGS / "grpo_math_1B_megatron.yaml"
EDITS = ["policy.generation.colocated.enabled=false"]


def test_grpo_math_1b_megatron_loads_with_the_same_one_edit():
    cfg, notes = load(MEGATRON, EDITS)
    p = cfg.policy
    assert p.megatron_cfg.enabled and (p.megatron_cfg.tensor_model_parallel_size, p.max_grad_norm) == (1, 1.0)
    assert (p.optimizer.name, p.optimizer.kwargs) == ("torch.optim.AdamW", {
        "lr": 5e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8})
    assert [s.name.rsplit(".", 1)[-1] for s in p.scheduler] == ["LinearLR"]  # warm-up 13 steps, then constant
    assert not p.activation_checkpointing
    keys = {key for key, _ in notes}
    assert {"policy.dtensor_cfg", "policy.megatron_cfg.optimizer.use_distributed_optimizer"} <= keys
    assert all("megatron_cfg.enabled is false" not in why for _, why in notes)


def test_megatron_workers_env_vars_go_to_the_trainer_and_dtensors_stay_inert():
    cfg = load_config(MEGATRON, [*EDITS, "++policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
                                 "++policy.dtensor_cfg.env_vars.NCCL_DEBUG=WARN"])
    assert cfg.trainer.env_vars == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}


@pytest.mark.parametrize("override, reason", [
    ("policy.megatron_cfg.expert_tensor_parallel_size=2", "expert tensor parallelism is not built"),
    ("policy.megatron_cfg.moe_enable_deepep=true", "DeepEP's dispatcher is not built"),
    ("policy.megatron_cfg.moe_token_dispatcher_type=flex", "'alltoall' or 'allgather'"),
    ("policy.megatron_cfg.expert_model_parallel_size=0", "greater than 0"),
    (["policy.megatron_cfg.expert_model_parallel_size=2", "policy.megatron_cfg.tensor_model_parallel_size=2"],
     "need sequence_parallel: true"),
    ("policy.megatron_cfg.fp8_cfg.enabled=true", "FP8 training is not built"),
    ("policy.megatron_cfg.scheduler.end_weight_decay=0.0", "a weight-decay schedule is not built"),
    ("policy.megatron_cfg.pipeline_dtype=float32", "at policy.precision"),
    ("policy.megatron_cfg.scheduler.lr_decay_style=WSD", "constant, linear or cosine"),
    ("++policy.megatron_cfg.no_such_key=1", "unknown key"),
])
def test_a_megatron_key_the_backend_does_not_run_is_refused_with_its_own_reason(override, reason):
    with pytest.raises(ConfigError) as err:
        load_config(MEGATRON, [*EDITS, *([override] if isinstance(override, str) else override)])
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and reason in lines[0], lines
    assert "megatron_cfg.enabled is false" not in lines[0]


def test_the_moe_keys_of_nemo_rls_qwen3_30b_a3b_recipe_reach_the_backends_config():
    """grpo_math_qwen30ba3b_megatron.yaml: TP 2, EP 8, sequence parallel, and the base file's MoE keys (router
    frozen, in float64, no load-balancing loss, alltoall); the kernel choices are noted, not kept."""
    cfg, notes = load(CONFIGS / "grpo_math_qwen30ba3b_megatron.yaml", EDITS)
    m = cfg.policy.megatron_cfg
    assert (m.tensor_model_parallel_size, m.expert_model_parallel_size, m.sequence_parallel) == (2, 8, True)
    assert m.context_parallel_size == 1
    assert (m.freeze_moe_router, m.moe_router_dtype, m.moe_router_load_balancing_type, m.moe_token_dispatcher_type
            ) == (True, "fp64", "none", "alltoall")
    keys = {key for key, _ in notes}
    assert {"policy.megatron_cfg.moe_permute_fusion", "policy.megatron_cfg.moe_router_bias_update_rate"} <= keys


def test_megatron_keys_stay_inert_while_it_is_disabled_and_the_dtensor_keys_while_it_is_enabled():
    _, notes = load(MEGATRON, [*EDITS, "policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true",
                               "policy.megatron_cfg.context_parallel_size=4", "policy.optimizer={name: AdamW, "
                               "kwargs: {lr: 1.0e-6}}", "policy.scheduler=[]"])
    assert ("policy.megatron_cfg.*", "accepted, no effect: inert while megatron_cfg.enabled is false, as in NeMo RL"
            ) in notes
    with pytest.raises(ConfigError, match="policy.dtensor_cfg.enabled: true with megatron_cfg.enabled true"):
        load_config(MEGATRON, [*EDITS, "policy.dtensor_cfg.enabled=true"])


def test_activation_checkpointing_and_clip_grad_move_to_the_keys_the_trainers_read():
    cfg = load_config(MEGATRON, [*EDITS, "policy.megatron_cfg.activation_checkpointing=true",
                                 "policy.megatron_cfg.optimizer.clip_grad=0.5"])
    assert cfg.policy.activation_checkpointing and cfg.policy.max_grad_norm == 0.5
    assert load_config(MEGATRON, [*EDITS, "policy.megatron_cfg.optimizer.clip_grad=0"]).policy.max_grad_norm is None


@pytest.mark.parametrize("style, warmup, decay", [("constant", 13, 1000), ("linear", 5, 20), ("cosine", 4, 25),
                                                  ("cosine", 0, 25), ("linear", 0, 20)])
def test_the_schedule_follows_megatron_cores_own_scheduler(style, warmup, decay):
    """The oracle is megatron-core's OptimizerParamScheduler, stepped once per step as NeMo RL's Megatron worker
    steps it; Flywheel builds the policy.scheduler list with torch's schedulers (services/trainer/optim.py)."""
    torch = require_module("torch")
    scheduler = require_module("megatron.core.optimizer_param_scheduler")
    from services.trainer.optim import build_optimizer, build_scheduler

    cfg = load_config(MEGATRON, [*EDITS, f"policy.megatron_cfg.scheduler.lr_decay_style={style}",
                                 f"policy.megatron_cfg.scheduler.lr_warmup_iters={warmup}",
                                 f"policy.megatron_cfg.scheduler.lr_decay_iters={decay}"])
    ours = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.policy.optimizer)
    sched = build_scheduler(ours, cfg.policy.scheduler)
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-6)
    reference = scheduler.OptimizerParamScheduler(theirs, init_lr=5e-7, max_lr=5e-6, min_lr=5e-7,
                                                  lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style,
                                                  start_wd=0.01, end_wd=0.01, wd_incr_steps=decay,
                                                  wd_incr_style="constant")
    for step in range(decay + 10):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-6), step
        ours.step()  # no gradients: only the schedule moves
        sched.step()
        reference.step(increment=1)


def test_a_fused_adam_is_torchs_adamw_with_its_moments_dtype():
    te = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    cfg, notes = load(CONFIGS / "grpo_math_1B.yaml", [
        *EDITS, f"policy.optimizer.name={te}", "++policy.optimizer.kwargs.master_weights=true",
        "++policy.optimizer.kwargs.store_param_remainders=true"])
    assert cfg.policy.optimizer.name == "torch.optim.AdamW" and "master_weights" not in cfg.policy.optimizer.kwargs
    assert any(key == "policy.optimizer.name" and te in why for key, why in notes)
    assert load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, "policy.optimizer.name=apex.optimizers.FusedAdam",
                                                       "++policy.optimizer.kwargs.adam_w_mode=false"]
                       ).policy.optimizer.name == "torch.optim.Adam"
    assert cfg.policy.optimizer.moments_dtype == "float32"
    bf16 = load_config(CONFIGS / "grpo_math_1B.yaml", [
        *EDITS, f"policy.optimizer.name={te}", "++policy.optimizer.kwargs.exp_avg_dtype=torch.bfloat16",
        "++policy.optimizer.kwargs.exp_avg_sq_dtype=torch.bfloat16"]).policy.optimizer
    assert bf16.moments_dtype == "bfloat16" and not {"exp_avg_dtype", "exp_avg_sq_dtype"} & set(bf16.kwargs)
    with pytest.raises(ConfigError, match=r"policy.optimizer.kwargs.exp_avg_sq_dtype: .*one dtype"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, f"policy.optimizer.name={te}",
                                                    "++policy.optimizer.kwargs.exp_avg_dtype=torch.bfloat16"])
    with pytest.raises(ConfigError, match=r"policy.optimizer.kwargs.exp_avg_dtype: .*'torch.uint8'.*float32 or"):
        load_config(CONFIGS / "grpo_math_1B.yaml", [*EDITS, f"policy.optimizer.name={te}",
                                                    "++policy.optimizer.kwargs.exp_avg_dtype=torch.uint8",
                                                    "++policy.optimizer.kwargs.exp_avg_sq_dtype=torch.uint8"])
