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

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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
    cls = _class(torch.optim, cfg.name)
    if cfg.moments_dtype != "float32":
        return AdamLowPrecisionMoments(params, decoupled=cls is torch.optim.AdamW,
                                       moments_dtype=getattr(torch, cfg.moments_dtype), **_tuples(cfg.kwargs))
    return cls(params, **_tuples(cfg.kwargs))


class AdamLowPrecisionMoments(Optimizer):
    """Adam, or AdamW with `decoupled` weight decay, keeping exp_avg and exp_avg_sq in `moments_dtype`
    (bfloat16: half the memory of torch's float32 moments). Each step reads the moments up to float32,
    updates them and the parameter there, and rounds them back once, as Transformer Engine's FusedAdam does with
    exp_avg_dtype / exp_avg_sq_dtype torch.bfloat16; otherwise the step is torch's Adam / AdamW. Works on
    FSDP2's DTensor shards as on plain tensors (every op is elementwise)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled: bool, moments_dtype: torch.dtype) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled, self.moments_dtype = decoupled, moments_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state to its parameter's dtype: the moments go back to theirs (exactly:
        they were saved in it), or a resumed run would step on float32 moments."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moments_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # torch's layout: a float32 step count, and the moments like the parameter
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
                state["step"] += 1
                t = state["step"].item()
                grad = p.grad.float()
                if decay and not self.decoupled:
                    grad = grad.add(p.float(), alpha=decay)
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if decay and self.decoupled:
                    p.mul_(1 - lr * decay)
                denom = (exp_avg_sq.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** t))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


@contextmanager
def state_in_host_memory(optimizer: Optimizer) -> Iterator[None]:
    """policy.offload_optimizer_for_logprob: every state tensor (FSDP2's DTensor shards included) copied to host
    memory for the block, its device copy freed for the block's forwards, and each put back on its own device after
    (Adam's step count stays where torch keeps it). A no-op for state already on the host."""
    moved = [(state, key, t.device) for state in optimizer.state.values() for key, t in state.items()
             if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    for state, key, _ in moved:
        state[key] = state[key].to("cpu")
    try:
        yield
    finally:
        for state, key, device in moved:
            state[key] = state[key].to(device)


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
