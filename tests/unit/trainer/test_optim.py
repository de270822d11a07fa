"""policy.optimizer and policy.scheduler as NeMo RL writes them give the learning rates they describe."""

import math

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.optim import build_optimizer, build_scheduler

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
