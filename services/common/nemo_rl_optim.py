"""NeMo RL's optimizer settings -> the torch classes Flywheel's trainers build (services/trainer/optim.py).

Two sources: Megatron-Core's OptimizerConfig and OptimizerParamScheduler (policy.megatron_cfg.optimizer and
.scheduler), and the fused Adam classes some DTensor recipes name (Transformer Engine's, Apex's), which take
the same step as torch's Adam or AdamW. A setting the torch class cannot take is refused with its reason.
"""

from __future__ import annotations

from typing import Any

from services.common.config_loader import Problem

MEGATRON = "policy.megatron_cfg"
FUSED_ADAM = ("transformer_engine.pytorch.optimizers", "apex.optimizers")
"""Modules whose FusedAdam is torch's AdamW (adam_w_mode true, the default) or Adam, computed in one kernel."""
FLOAT32 = ("torch.float32", "float32", None)
FUSED_ONLY = {
    "bias_correction": (lambda v: v is True, "torch's Adam always corrects the bias"),
    "master_weights": (lambda v: True, "the FSDP2 trainer keeps float32 parameters and steps on them"),
    "store_param_remainders": (lambda v: True, "the FSDP2 trainer keeps float32 parameters and steps on them"),
    "master_weight_dtype": (lambda v: v in FLOAT32, "the FSDP2 trainer keeps float32 parameters"),
    "capturable": (lambda v: True, "CUDA-graph capture: speed, not the step"),
    "set_grad_none": (lambda v: True, "how gradients are cleared: not the step"),
    "use_decoupled_grad": (lambda v: True, "where gradients are read from: not the step"),
}
"""FusedAdam keywords torch's Adam lacks: (accepted at this value, why)."""


MOMENTS = {"torch.float32": "float32", "float32": "float32", None: "float32",
           "torch.bfloat16": "bfloat16", "bfloat16": "bfloat16"}
"""FusedAdam's exp_avg_dtype / exp_avg_sq_dtype -> policy.optimizer.moments_dtype. Its float16 and uint8 (FP8)
moments are kept scaled by a per-tensor factor, which Flywheel's Adam does not build."""


def fused_adam(opt: Any, problems: list[Problem], notes: list[Problem]) -> None:
    """policy.optimizer naming a fused Adam -> torch.optim.AdamW or Adam with the keywords torch takes, its moments'
    dtype -> policy.optimizer.moments_dtype."""
    name = opt.get("name") if isinstance(opt, dict) else None
    if not isinstance(name, str) or not name.startswith(FUSED_ADAM) or not name.endswith(".FusedAdam"):
        return
    kwargs = dict(opt.get("kwargs") or {})
    opt["name"] = "torch.optim.AdamW" if kwargs.pop("adam_w_mode", True) else "torch.optim.Adam"
    for key, (ok, why) in FUSED_ONLY.items():
        if key in kwargs and not ok(value := kwargs.pop(key)):
            problems.append((f"policy.optimizer.kwargs.{key}", f"Flywheel cannot honour {value!r}: {why}"))
    moments = {key: kwargs.pop(key, None) for key in ("exp_avg_dtype", "exp_avg_sq_dtype")}
    for key, value in moments.items():
        if value not in MOMENTS:
            problems.append((f"policy.optimizer.kwargs.{key}", f"Flywheel cannot honour {value!r}: Adam's moments "
                             "are kept in float32 or bfloat16 (policy.optimizer.moments_dtype)"))
    dtypes = {MOMENTS[v] for v in moments.values() if v in MOMENTS}
    if len(dtypes) > 1:
        problems.append(("policy.optimizer.kwargs.exp_avg_sq_dtype", f"Flywheel cannot honour {moments}: both "
                         "moments are kept in one dtype (policy.optimizer.moments_dtype)"))
    elif dtypes == {"bfloat16"}:
        opt["moments_dtype"] = "bfloat16"
    opt["kwargs"] = kwargs
    moments = " with bfloat16 moments" if opt.get("moments_dtype") == "bfloat16" else ""
    notes.append(("policy.optimizer.name",
                  f"accepted as {opt['name']}{moments}: {name} takes the same step in one kernel"))


def megatron_optimizer(opt: dict, problems: list[Problem]) -> dict:
    """Megatron-Core's OptimizerConfig -> the torch class it runs: adam is AdamW unless decoupled_weight_decay
    is false (megatron/core/optimizer/__init__.py)."""
    kind = opt.pop("optimizer", "adam")
    decoupled = opt.pop("decoupled_weight_decay", True)
    kwargs = {"lr": opt.pop("lr", None), "weight_decay": opt.pop("weight_decay", 0.01)}
    adam = {"betas": [opt.pop("adam_beta1", 0.9), opt.pop("adam_beta2", 0.999)], "eps": opt.pop("adam_eps", 1e-8)}
    if kind == "adam":
        kwargs |= adam
        return {"name": "torch.optim.AdamW" if decoupled else "torch.optim.Adam", "kwargs": kwargs}
    problems.append((f"{MEGATRON}.optimizer.optimizer",
                     f"Flywheel cannot honour {kind!r}: the Megatron backend takes adam (its SGD passes no momentum)"))
    return {"name": "torch.optim.AdamW", "kwargs": kwargs}


def schedule(s: dict, lr: float, low: float, steps: int | None, problems: list[Problem]) -> list[dict]:
    """Megatron's OptimizerParamScheduler as NeMo RL's policy.scheduler list of torch schedulers (optim.py)."""
    style, warm = s.pop("lr_decay_style", "constant"), s.pop("lr_warmup_iters", 0) or 0
    init, decay = s.pop("lr_warmup_init", 0.0), s.pop("lr_decay_iters", None) or steps
    out = []
    if warm:
        if not 0 < init <= lr:
            problems.append((f"{MEGATRON}.scheduler.lr_warmup_init",
                             f"Flywheel cannot honour {init!r}: a warm-up starts above 0 and at most at lr (torch's "
                             "LinearLR)"))
            return []
        out.append(_sched("LinearLR", start_factor=init / lr, end_factor=1.0, total_iters=warm))
    if style == "constant":
        return out
    if style not in ("linear", "cosine") or not decay or decay <= warm:
        problems.append((f"{MEGATRON}.scheduler.lr_decay_style",
                         f"Flywheel cannot honour {style!r} decay over {decay!r} steps: constant, linear or cosine, "
                         "to lr_decay_iters after the warm-up"))
        return out
    if not 0 <= low <= lr:
        problems.append((f"{MEGATRON}.optimizer.min_lr", f"Flywheel cannot honour {low!r}: decay ends between 0 and lr"))
        return out
    span = decay - warm
    if style == "linear":  # LinearLR holds its end factor after total_iters: min_lr from then on
        out.append(_sched("LinearLR", start_factor=1.0, end_factor=low / lr, total_iters=span))
    else:  # CosineAnnealingLR would rise again after T_max: hand over to min_lr there
        out += [_sched("CosineAnnealingLR", T_max=span, eta_min=low),
                _sched("ConstantLR", factor=low / lr, total_iters=10**10)]
    marks = [warm] if warm else []
    return [*out, {"milestones": marks + ([decay] if style == "cosine" else [])}] if len(out) > 1 else out


def number(v: Any) -> Any:
    """YAML 1.1 reads 1e-8 (no dot) as a string; NeMo RL's configs write it so and mean a number."""
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v


def _sched(name: str, **kwargs: Any) -> dict:
    return {"name": f"torch.optim.lr_scheduler.{name}", "kwargs": kwargs}
