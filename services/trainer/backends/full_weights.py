"""The whole weights for a sync, from a sharded model: cast before the gather, kept only on the sending rank.

    for each state-dict entry: shard --cast to the sync dtype--> all-gather over its mesh --> rank 0 keeps it
                                                                                           (others drop it)

So no rank holds the whole model in fp32, nor two copies of it: rank 0 ends with the dict in the sync dtype
on the device the weight channel sends from, every other rank with nothing, and in flight each rank holds one
whole tensor. LoRA's adapted layers are the exception that proves it: merge_lora computes in fp32, so their
base weight and adapters gather in fp32 and each layer is merged, then cast, as soon as its three are in.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from services.trainer.lora import A_SUFFIX, B_SUFFIX, merge_lora


def gathered(model: torch.nn.Module, dtype: torch.dtype, fp32: set[str]) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) in state-dict order, each cast to `dtype` (those in `fp32` to float32) before its
    all-gather. Every rank must draw every item: each gather is a collective."""
    for name, value in model.state_dict().items():
        cast = value.to(torch.float32 if name in fp32 else dtype)
        yield name, cast.full_tensor() if isinstance(cast, DTensor) else cast


def lora_layers(names) -> dict[str, str]:
    """Entry name -> its adapted layer's prefix, for each adapter's A, B and the base weight they merge into."""
    prefixes = {n[: -len(A_SUFFIX)] for n in names if n.endswith(A_SUFFIX)}
    return {p + suffix: p for p in prefixes for suffix in (A_SUFFIX, B_SUFFIX, ".weight")}


def full_weights(model: torch.nn.Module, dtype: torch.dtype, *, keep: bool, device: torch.device,
                 lora_scale: float | None = None) -> dict[str, Tensor]:
    """The model's Hugging Face state dict in `dtype` on `device` where `keep`, else {} (the gathers still run).
    With `lora_scale`, adapters are merged (merge_lora) and dropped; the order is merge_lora's."""
    layers = lora_layers(model.state_dict()) if lora_scale is not None else {}
    out: dict[str, Tensor | None] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    for name, whole in gathered(model, dtype, set(layers)):
        if not keep:
            continue
        if name not in layers:
            out[name] = whole.to(device)
            continue
        prefix = layers[name]
        if name == prefix + ".weight":
            out[name] = None  # holds the merged weight's place in the order
        part = parts.setdefault(prefix, {})
        part[name] = whole
        if len(part) == 3:
            merged = merge_lora(parts.pop(prefix), lora_scale)[prefix + ".weight"]
            out[prefix + ".weight"] = merged.to(dtype).to(device)
    return out
