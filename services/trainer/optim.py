"""Optimizer and learning-rate schedule from NeMo RL's `policy.optimizer` and `policy.scheduler`.

    optimizer: {name: torch.optim.AdamW, kwargs: {lr: 5e-6, weight_decay: 0.01, betas: [0.9, 0.999]}}
    scheduler:
      - {name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, total_iters: 50}}
      - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0, total_iters: 10000000000}}
      - {milestones: [50]}

Several schedulers run one after another (SequentialLR) and hand over at the milestones.
The schedule advances once per trainer step (one rollout batch), as NeMo RL's policy
workers step it after all of a batch's optimizer steps, so milestones count GRPO steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, SequentialLR

from services.common.config import OptimizerConfig, SchedulerMilestones, SchedulerStep


def _class(module, dotted: str):
    name = dotted.rsplit(".", 1)[-1]
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{dotted}: no such class in {module.__name__}")
    return cls


def _tuples(kwargs: dict) -> dict:
    """YAML has lists only; torch wants tuples for betas and similar pairs."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> Optimizer:
    return _class(torch.optim, cfg.name)(params, **_tuples(cfg.kwargs))


def build_scheduler(optimizer: Optimizer, entries: list[SchedulerStep | SchedulerMilestones]) -> LRScheduler:
    """The schedule NeMo RL's list describes; a constant one when the list is empty."""
    steps = [e for e in entries if isinstance(e, SchedulerStep)]
    schedulers = [_class(torch.optim.lr_scheduler, s.name)(optimizer, **_tuples(s.kwargs)) for s in steps]
    if not schedulers:
        return LambdaLR(optimizer, lambda _: 1.0)
    if len(schedulers) == 1:
        return schedulers[0]
    milestones = next(e.milestones for e in entries if isinstance(e, SchedulerMilestones))
    return SequentialLR(optimizer, schedulers, milestones=milestones)
