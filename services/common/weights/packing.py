"""Copying tensors into and out of flat bucket buffers, following a `plan_buckets` plan.

Kept apart from `manifest.py` (pure layout) because this touches memory. Works for CPU and CUDA tensors:
the buffer and the tensors must live on the same device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.common.weights.manifest import Bucket, Slot


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def new_buffer(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat uint8 staging buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def pack(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into `out[:bucket.nbytes]` and return that slice."""
    flat = out[: bucket.nbytes]
    for slot in bucket.slots:
        src = tensors[slot.spec.name].detach()
        region = flat[slot.offset : slot.offset + slot.spec.nbytes]
        # copy_ on a typed view converts layout (non-contiguous sources) without an extra temporary.
        region.view(slot.spec.dtype).view(slot.spec.shape).copy_(src)
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor, into: Mapping[str, torch.Tensor]) -> None:
    """Copy each tensor of a received bucket from `flat` into its destination in `into`."""
    for slot in bucket.slots:
        into[slot.spec.name].copy_(_typed(slot, flat))


def _typed(slot: Slot, flat: torch.Tensor) -> torch.Tensor:
    region = flat[slot.offset : slot.offset + slot.spec.nbytes]
    return region.view(slot.spec.dtype).view(slot.spec.shape)


def whole_source(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tensor of a whole bucket as a flat byte view; its own storage when contiguous (no copy)."""
    return _byte_view(tensors[bucket.slots[0].spec.name].detach().contiguous())


def whole_destination(bucket: Bucket, into: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Where a whole bucket lands: the destination itself when contiguous, else a temporary.

    Returns (flat byte tensor, needs_copy_back).
    """
    dst = into[bucket.slots[0].spec.name]
    if dst.is_contiguous():
        return _byte_view(dst), False
    return new_buffer(bucket.nbytes, dst.device), True
