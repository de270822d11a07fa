"""Weight-channel data paths behind one small interface, chosen by name with `make_backend`.

The channel (`channel.py`) owns rendezvous, membership, acks and retries; a backend only moves the bytes of
one epoch. Sender side, per epoch: `send` (returns once the data is out or available to read), then
`release` after the receivers confirmed or the epoch was abandoned. Receiver side: `receive` fills `into`.

| name         | how bytes move                                                    | device |
|--------------|-------------------------------------------------------------------|--------|
| `gloo`       | ProcessGroupGloo broadcast of flat buckets, double-buffered       | CPU    |
| `nccl`       | the same code path with CUDA tensors and ProcessGroupNCCL         | GPU    |
| `nixl`       | receivers READ the trainer's registered buckets over UCX          | CPU/GPU|
| `filesystem` | safetensors file per version in a shared directory (tmp + rename) | any    |
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed import Store

from services.common.weights.manifest import Bucket
from services.common.weights.rendezvous import Deadline


OnBucket = Callable[[Bucket], None] | None


@dataclass(kw_only=True, slots=True)
class Epoch:
    """What one side knows about the epoch it takes part in."""

    group_store: Store
    """The epoch's prefixed view of the trainer's store: process-group rendezvous."""
    store: Store
    """This version's round inside the epoch: side-channel keys (NIXL descriptors, file name, abort)."""
    epoch: int
    """Sync epoch number."""
    version: int
    """Policy version carried."""
    rank: int
    """0 for the trainer, i + 1 for member i."""
    world_size: int
    """1 + number of members."""
    plan: list[Bucket]
    """Buckets, identical on both sides."""
    host: str
    """Address this side's data connections bind to."""
    path: str = ""
    """Filesystem backend: shared directory."""
    collective_timeout_s: float = 30.0
    """Bound on every collective op of this round, set by the sender so both sides fail at the same time."""
    new_group: bool = True
    """First round of the epoch: build its process group. False: reuse the group of the previous round."""


class Backend(ABC):
    """Moves one epoch's bytes. One instance per sender or receiver; may keep resources across epochs."""

    name: str = ""
    whole_bytes: int = 1 << 20
    """Default `plan_buckets` threshold: tensors of at least this many bytes travel as themselves, smaller ones
    are packed. Packing costs a copy on each side and saves a transfer's fixed cost."""

    @abstractmethod
    def send(self, ep: Epoch, tensors: Mapping[str, torch.Tensor], deadline: Deadline) -> None:
        """Trainer side: make the epoch's bytes reach (or be readable by) every member. Raises on failure."""

    @abstractmethod
    def receive(
        self, ep: Epoch, into: Mapping[str, torch.Tensor], deadline: Deadline, on_bucket: OnBucket = None
    ) -> None:
        """Receiver side: fill `into` (same manifest) with the epoch's bytes. Raises on failure.

        `on_bucket(bucket)` is called once per bucket, in plan order, as soon as its tensors in `into` are
        final; the channel folds its checksum there, overlapping the transfer of the next bucket.
        """

    def wait(self, seconds: float) -> None:
        """Trainer side, after `send`: let `seconds` pass while receivers finish and confirm. Backends whose
        sender must act for receivers to progress (nixl) do that work here."""
        time.sleep(seconds)

    def release(self, ep: Epoch) -> None:
        """Trainer side: the epoch is over (acked or abandoned); free what `send` kept alive for readers."""

    def close(self) -> None:
        """Free everything; the instance is not used again."""


BACKENDS = ("gloo", "nccl", "nixl", "filesystem")


def make_backend(name: str) -> Backend:
    """The one factory: backend instance by name. Heavy or optional imports happen only for the one asked."""
    if name in ("gloo", "nccl"):
        from services.common.weights.backends.collective import CollectiveBackend

        return CollectiveBackend(name)
    if name == "nixl":
        from services.common.weights.backends.nixl import NixlBackend

        return NixlBackend()
    if name == "filesystem":
        from services.common.weights.backends.filesystem import FilesystemBackend

        return FilesystemBackend()
    raise ValueError(f"unknown weight backend {name!r}; expected one of {BACKENDS}")
