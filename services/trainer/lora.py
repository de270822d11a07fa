"""LoRA on the FSDP2 trainer's linear layers (NeMo RL's `policy.dtensor_cfg.lora_cfg`, Automodel's semantics).

    y = x Wᵀ + b + scale · B(A(drop_pre(x)))   then drop_post on the LoRA term;   scale = alpha / dim

W and b stay where the Hugging Face model keeps them (same names) and are frozen; only A [dim, in] and
B [out, dim] train, and B starts at zero, so step 0 is the base model. Rollout never sees an adapter:
the weights published to it and written by `flywheel export` are merged, W + scale · B A (`merge_lora`),
as NeMo RL's refit does. The reference policy is the base model itself (`adapters_off`): W never moves,
so no second copy of the weights is needed for the KL term.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.common.config import LoRAConfig

log = logging.getLogger("flywheel.trainer")

A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


class LoRALinear(nn.Linear):
    """An nn.Linear plus a low-rank update; `weight` and `bias` keep their names and are frozen."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kind = {"device": base.weight.device, "dtype": torch.float32}  # fp32 like FSDP2's master weights
        self.lora_A = nn.Linear(base.in_features, cfg.dim, bias=False, **kind)
        self.lora_B = nn.Linear(cfg.dim, base.out_features, bias=False, **kind)
        init_lora_a(self.lora_A.weight, cfg.lora_A_init)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = cfg.scale
        self.dropout, self.dropout_position = cfg.dropout, cfg.dropout_position
        self.enabled = True

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        h = F.dropout(x, self.dropout, self.training) if self.dropout_position == "pre" else x
        update = self.lora_B(self.lora_A(h.to(self.lora_A.weight.dtype))) * self.scale
        if self.dropout_position == "post":
            update = F.dropout(update, self.dropout, self.training)
        return out + update.to(out.dtype)


@torch.no_grad()
def init_lora_a(weight: Tensor, method: str) -> None:
    """Automodel's two initialisations. Its "xavier" draws U(0, 1) (not Glorot's bound); kept as it is so a
    NeMo RL recipe's learning rate means what it was tuned for. "kaiming" is nn.Linear's default."""
    if method == "xavier":
        nn.init.uniform_(weight)
    else:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Freeze the model and put an adapter on each matched linear layer, in place; returns their names.

    Every rank draws the same A from `seed`, as FSDP2 shards identical full modules. A linear layer whose
    weight another module shares (a tied lm_head) is left out: the published weights carry one copy of a
    tied weight, so an update merged into it would also change the embedding."""
    model.requires_grad_(False)
    shared = _shared_weights(model)
    names = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for name, module in list(model.named_modules()):
            if not (isinstance(module, nn.Linear) and matches(cfg, name)):
                continue
            if id(module.weight) in shared:
                log.warning("LoRA: %s shares its weight with another module (tied embeddings); no adapter", name)
                continue
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, LoRALinear(module, cfg))
            names.append(name)
    if not names:
        raise ValueError(f"policy.lora_cfg matched no linear layer of {type(model).__name__} "
                         f"(target_modules {cfg.target_modules}, exclude_modules {cfg.exclude_modules})")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA on %d linear layers: %d trainable of %d parameters", len(names), trainable,
             sum(p.numel() for p in model.parameters()))
    return names


def matches(cfg: LoRAConfig, name: str) -> bool:
    """Automodel's rule: every linear layer with match_all_linear; else those target_modules name; else all but
    those exclude_modules name; neither given means target_modules ["*_proj"]. A pattern names a module by its
    full dotted name or its last part, `*` matching any run of characters (dots included)."""
    if cfg.match_all_linear:
        return True
    named = lambda patterns: any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rpartition(".")[2], p)
                                 for p in patterns)
    if cfg.target_modules:
        return named(cfg.target_modules)
    if cfg.exclude_modules:
        return not named(cfg.exclude_modules)
    return named(["*_proj"])


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model, for the reference policy's logprobs: every adapter's update left out."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


@torch.no_grad()
def merge_lora(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A full state dict with adapters -> the Hugging Face one: each W + scale · B A (in float32), the
    lora_A/lora_B entries dropped. The input's other tensors are passed through as they are."""
    out = {k: v for k, v in state.items() if not k.endswith((A_SUFFIX, B_SUFFIX))}
    for key, value in state.items():
        if key.endswith(A_SUFFIX):
            prefix = key[: -len(A_SUFFIX)]
            a, b = value.float(), state[prefix + B_SUFFIX].float()
            base = state[prefix + ".weight"]
            out[prefix + ".weight"] = (base.float() + scale * (b @ a)).to(base.dtype)
    return out
