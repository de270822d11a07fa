"""The Megatron backend's learning-rate schedule and weight decay, on Megatron-Core's own parameter groups of a GPTModel
built on CPU, against Megatron-Core's OptimizerParamScheduler: what NeMo RL's Megatron worker steps once per
training step. Megatron's optimizer wrapper (DDP's gradient buffers, Float16OptimizerWithFloat16Params) allocates on
CUDA, so here the groups sit in the torch AdamW that get_megatron_optimizer would wrap; that wrapping, and the
backend stepping the schedule inside train_step, run on GPU only and have not been executed here."""

from pathlib import Path

import pytest
import torch
from needs import require_module
from test_megatron_build import hf_model, one_rank, policy  # noqa: F401 (one_rank is a fixture)

require_module("megatron.core")
from megatron.core.optimizer import _get_param_groups  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.trainer.backends.megatron import optimizer_config, restore, schedule  # noqa: E402
from services.trainer.backends.megatron_model import build_gpt  # noqa: E402

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures/nemo_rl/examples/configs/grpo_math_1B_megatron.yaml"
LR, MIN_LR, INIT_LR, WD = 5e-6, 5e-7, 1e-6, 0.01


def recipe(style: str, warmup: int, decay: int):
    """NeMo RL's Megatron recipe, its schedule mapped by nemo_rl_megatron.py onto policy.optimizer / scheduler."""
    m = "policy.megatron_cfg"
    return load_config(MEGATRON, [
        "policy.generation.colocated.enabled=false", f"{m}.optimizer.lr={LR}", f"{m}.optimizer.min_lr={MIN_LR}",
        f"{m}.optimizer.weight_decay={WD}", f"{m}.scheduler.lr_warmup_init={INIT_LR}",
        f"{m}.scheduler.lr_decay_style={style}", f"{m}.scheduler.lr_warmup_iters={warmup}",
        f"{m}.scheduler.lr_decay_iters={decay}"])


def megatron_adamw(gpt, cfg) -> torch.optim.AdamW:
    """Megatron-Core's param groups of `gpt` (biases and norms wd_mult 0) in the torch AdamW get_megatron_optimizer
    builds from its OptimizerConfig."""
    oc = optimizer_config(cfg, gpt.config)
    assert oc.optimizer == "adam" and oc.decoupled_weight_decay  # torch.optim.AdamW
    oc.min_lr = MIN_LR  # what OptimizerParamScheduler decays to, from each group; the backend's is in its schedule
    return torch.optim.AdamW(_get_param_groups([gpt], oc, None), lr=oc.lr, weight_decay=oc.weight_decay,
                             betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps)


def reference(optimizer, warmup: int, decay: int, style: str) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, init_lr=INIT_LR, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=warmup,
                                   lr_decay_steps=decay, lr_decay_style=style, start_wd=WD, end_wd=WD,
                                   wd_incr_steps=decay, wd_incr_style="constant")


def settings(optimizer) -> list[float]:
    """lr, weight decay, lr, weight decay, ... of each group in turn."""
    return [x for g in optimizer.param_groups for x in (g["lr"], g["weight_decay"])]


@pytest.mark.parametrize("style, warmup, decay", [("cosine", 4, 12), ("linear", 3, 10), ("constant", 5, 1000)])
def test_each_group_follows_megatron_cores_scheduler_in_lr_and_weight_decay(one_rank, style, warmup, decay):
    cfg = recipe(style, warmup, decay)
    _, gpt = build_gpt(hf_model(policy()), policy(), cpu=True)
    ours, theirs = megatron_adamw(gpt, cfg), megatron_adamw(gpt, cfg)
    schedulers = schedule([ours], cfg.policy.scheduler)
    ref = reference(theirs, warmup, decay, style)
    assert set(settings(theirs)[1::2]) == {0.0, WD}  # norms undecayed, matrices decayed
    seen = []
    for step in range(min(decay, 20) + 5):
        assert settings(ours) == pytest.approx(settings(theirs), rel=1e-6), step
        seen.append(ours.param_groups[0]["lr"])
        ours.step()  # no gradients: only the schedule moves
        for s in schedulers:
            s.step()
        ref.step(increment=1)
    assert len(set(seen)) > 2  # the schedule moved (warm-up at least)


def test_a_resumed_schedule_goes_on_where_it_stopped_though_adams_state_is_not_saved(one_rank):
    cfg = recipe("cosine", 3, 12)
    _, gpt = build_gpt(hf_model(policy()), policy(), cpu=True)
    first = megatron_adamw(gpt, cfg)
    schedulers = schedule([first], cfg.policy.scheduler)
    for _ in range(5):
        first.step()
        schedulers[0].step()
    saved = [s.state_dict() for s in schedulers]
    resumed = megatron_adamw(gpt, cfg)
    again = schedule([resumed], cfg.policy.scheduler)
    restore([resumed], again, saved)
    for step in range(10):
        assert settings(resumed) == pytest.approx(settings(first), rel=1e-9), step
        for o, s in ((first, schedulers[0]), (resumed, again[0])):
            o.step()
            s.step()
