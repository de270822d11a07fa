"""Copying tensors into and out of flat bucket buffers, following a `plan_buckets` plan.

Kept apart from `manifest.py` (pure layout) because this touches memory. Works for CPU and CUDA tensors:
the buffer and the tensors must live on the same device.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
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
        _copy(_typed(slot, flat), tensors[slot.spec.name].detach())
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor, into: Mapping[str, torch.Tensor]) -> None:
    """Copy each tensor of a received bucket from `flat` into its destination in `into`."""
    for slot in bucket.slots:
        _copy(into[slot.spec.name].detach(), _typed(slot, flat))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), on the calling thread alone for host tensors of one layout.

    torch splits a host copy of more than 32k elements over its intra-op (OpenMP) threads. During a sync the
    transport's own threads keep the cores busy, so each such copy waits for a second thread to get a core:
    unpacking the 100 MB decoder's 3.7 MB bucket took 23 ms in a receiver with two receivers on two cores,
    against 0.7 ms on one thread (docs/weight_sync.md). numpy copies on the calling thread. Anything else (a
    device, a non-contiguous source, which copy_ converts without a temporary) goes through copy_.
    """
    if dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape \
            and dst.is_contiguous() and src.is_contiguous():
        np.copyto(_byte_view(dst).numpy(), _byte_view(src).numpy())
    else:
        dst.copy_(src)


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
