"""policy.optimizer and policy.scheduler as NeMo RL writes them give the learning rates they describe."""

import math

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.optim import AdamLowPrecisionMoments, build_optimizer, build_scheduler

WARMUP = ("policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, end_factor: 1.0, "
          "total_iters: 4}}, {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0, total_iters: 1000}}, "
          "{milestones: [4]}]")
COSINE = ("policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.5, total_iters: 2}}, "
          "{name: torch.optim.lr_scheduler.CosineAnnealingLR, kwargs: {T_max: 4, eta_min: 0.0}}, {milestones: [2]}]")


def lrs(*overrides: str, steps: int = 8) -> list[float]:
    cfg = load_config(None, ["policy.optimizer.kwargs={lr: 1.0, weight_decay: 0.01, betas: [0.9, 0.99]}", *overrides])
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = build_optimizer(params, cfg.policy.optimizer)
    scheduler = build_scheduler(optimizer, cfg.policy.scheduler)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_linear_warmup_then_constant():
    assert lrs(WARMUP) == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0, 1.0, 1.0, 1.0])


def test_warmup_then_cosine_hands_over_at_the_milestone():
    cosine = [0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(6)]
    assert lrs(COSINE) == pytest.approx([0.5, 0.75, *cosine])


def test_no_scheduler_keeps_lr_constant_and_optimizer_kwargs_are_used():
    assert lrs() == [1.0] * 8
    cfg = load_config(None, ["policy.optimizer={name: SGD, kwargs: {lr: 0.5, momentum: 0.9}}"])
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.policy.optimizer)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9


@pytest.mark.parametrize("override", [
    "policy.optimizer={name: torch.optim.AdamW, kwargs: {weight_decay: 0.1}}",  # no lr
    "policy.optimizer.name=os.system",
    "policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR}, {name: torch.optim.lr_scheduler.ConstantLR}]",
    "policy.optimizer={name: SGD, kwargs: {lr: 0.1}, moments_dtype: bfloat16}",  # SGD has no moments
    "policy.optimizer={name: AdamW, kwargs: {lr: 0.1, amsgrad: true}, moments_dtype: bfloat16}",  # not built
])
def test_bad_optimizer_or_scheduler_is_a_config_error(override):
    with pytest.raises(ConfigError):
        load_config(None, [override])


def test_yaml_1_1_exponents_without_a_dot_are_numbers():
    """NeMo RL configs write lr: 5e-6, which YAML 1.1 reads as a string."""
    cfg = load_config(None, ["policy.optimizer.kwargs.lr=5e-6", "policy.scheduler=[{name: LinearLR, kwargs: "
                                                                  "{start_factor: 1e-1, total_iters: 2}}]"])
    assert cfg.policy.optimizer.kwargs["lr"] == 5e-6
    assert cfg.policy.scheduler[0].kwargs["start_factor"] == 0.1


KWARGS = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _steps(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, grads: torch.Tensor,
           round_moments: bool = False) -> list[torch.Tensor]:
    """The parameter after each step of `grads`; `round_moments` rounds torch's own moments to bfloat16 after each
    step, the slow reference for bfloat16 moments."""
    out = []
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        if round_moments:
            for state in optimizer.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key].copy_(state[key].bfloat16())
        out.append(param.detach().clone())
    return out


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_with_float32_moments_steps_as_torchs_adam(decoupled):
    """The oracle for the update itself: torch's Adam / AdamW on the same gradients, bit for bit."""
    grads = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    start = torch.randn(64, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = (torch.optim.AdamW if decoupled else torch.optim.Adam)([theirs], **KWARGS)
    mine = AdamLowPrecisionMoments([ours], decoupled=decoupled, moments_dtype=torch.float32, **KWARGS)
    assert [torch.equal(a, b) for a, b in zip(_steps(mine, ours, grads), _steps(reference, theirs, grads))] == [True] * 6


def test_bfloat16_moments_are_stored_in_bfloat16_and_step_as_torchs_adamw_with_its_moments_rounded():
    """moments_dtype bfloat16 from the config: the moments take half the memory, and each step is torch's AdamW
    whose moments are rounded to bfloat16 after every step (the update itself in float32)."""
    cfg = load_config(None, ["policy.optimizer={name: torch.optim.AdamW, kwargs: {lr: 0.01, betas: [0.9, 0.99], "
                             "weight_decay: 0.1}, moments_dtype: bfloat16}"])
    grads = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    start = torch.randn(64, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    mine = build_optimizer([ours], cfg.policy.optimizer)
    got = _steps(mine, ours, grads)
    want = _steps(torch.optim.AdamW([theirs], **KWARGS), theirs, grads, round_moments=True)
    assert {mine.state[ours][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    unrounded = _steps(torch.optim.AdamW([p := torch.nn.Parameter(start.clone())], **KWARGS), p, grads)
    assert not torch.equal(got[-1], unrounded[-1])  # the rounding is there: float32 moments step elsewhere


def test_bfloat16_moments_are_the_fsdp2_trainers():
    with pytest.raises(ConfigError, match="moments_dtype is the FSDP2 backend's"):
        load_config(None, ["policy.megatron_cfg.enabled=true", "policy.optimizer.moments_dtype=bfloat16"])
