"""gloo and nccl: broadcast of flat buckets from rank 0 over a process group made for this epoch only.

The group is built directly on the epoch's PrefixStore (never `init_process_group`), so one process can hold
several, and a failed epoch's group is abandoned without touching the next one. A group lives as long as its
epoch: later versions for the same members reuse it (no reconnect); a failure or a new epoch ends it.

Double buffering, sender (two staging buffers, at most two broadcasts in flight):

    pack b0 -> A ; bcast(A) ...........
                   pack b1 -> B ; bcast(B) ...........
                                  wait bcast(A); pack b2 -> A ; bcast(A) ...

Receivers keep as many broadcasts posted as the sender and unpack a bucket while the next ones arrive. A
whole bucket (one tensor larger than a bucket, or at least `whole_bytes`) is broadcast from (and into) the
tensor itself, without staging.
Every wait carries the epoch's collective timeout, so a stalled or dead peer turns into an exception.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions

from services.common.weights.backends import Backend, Epoch, OnBucket
from services.common.weights.manifest import Bucket
from services.common.weights.packing import new_buffer, pack, unpack, whole_destination, whole_source
from services.common.weights.rendezvous import Deadline

IN_FLIGHT = 2


class CollectiveBackend(Backend):
    # gloo on loopback: a broadcast costs ~0.4 ms on top of its bytes, about what packing 1 MiB costs (copy in,
    # copy out); benchmarks/weight_sync.py, decoder layout. NCCL's fixed cost is far smaller, but so is a copy.
    whole_bytes = 1 << 20

    def __init__(self, name: str):
        if name not in ("gloo", "nccl"):
            raise ValueError(name)
        self.name = name
        self.buffers: list[torch.Tensor] = []
        self.group: tuple[int, object] | None = None  # (epoch, process group) of the live epoch

    # -- group ---------------------------------------------------------------------------------------------

    def _group(self, ep: Epoch, deadline: Deadline):
        """The epoch's group: built on its first round, then reused while the epoch lives."""
        if not ep.new_group:
            if self.group is None or self.group[0] != ep.epoch:
                # E.g. a restarted receiver announced into a running epoch: it cannot join that group.
                raise RuntimeError(f"no live process group for epoch {ep.epoch}")
            return self.group[1]
        self.end_epoch()
        pg = self._new_group(ep, deadline)
        self.group = (ep.epoch, pg)
        return pg

    def _new_group(self, ep: Epoch, deadline: Deadline):
        timeout = timedelta(seconds=min(ep.collective_timeout_s, max(0.05, deadline.left())))
        if self.name == "gloo":
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._devices = [ProcessGroupGloo.create_device(hostname=ep.host)]
            opts._timeout = timeout
            return ProcessGroupGloo(ep.group_store, ep.rank, ep.world_size, opts)
        from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        return ProcessGroupNCCL(ep.group_store, ep.rank, ep.world_size, opts)

    def end_epoch(self) -> None:
        """Shut down the current epoch's group (members changed, or closing)."""
        if self.group is not None:
            _drop(self.group[1])
            self.group = None

    def _fail(self) -> None:
        if self.group is not None:
            abandon(self.group[1])
            self.group = None

    def _opts(self, ep: Epoch, deadline: Deadline) -> BroadcastOptions:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=min(ep.collective_timeout_s, max(0.05, deadline.left())))
        return opts

    def _device(self, tensors: Mapping[str, torch.Tensor]) -> torch.device:
        if self.name == "gloo":
            return torch.device("cpu")
        return next(iter(tensors.values())).device

    def _staging(self, plan: list[Bucket], device: torch.device) -> list[torch.Tensor]:
        """Two staging buffers sized for the largest packed bucket, reused across epochs."""
        size = max((b.nbytes for b in plan if not b.whole), default=0)
        if size == 0:
            return []
        if len(self.buffers) != 2 or self.buffers[0].numel() < size or self.buffers[0].device != device:
            self.buffers = [new_buffer(size, device), new_buffer(size, device)]
        return self.buffers

    # -- sender --------------------------------------------------------------------------------------------

    def send(self, ep: Epoch, tensors: Mapping[str, torch.Tensor], deadline: Deadline) -> None:
        pg = self._group(ep, deadline)
        try:
            bufs = self._staging(ep.plan, self._device(tensors))
            busy: list = [None, None]  # work still reading each staging buffer
            pending: deque = deque()
            k = 0
            for bucket in ep.plan:
                if bucket.whole:
                    src = whole_source(bucket, tensors)
                else:
                    j, k = k % 2, k + 1
                    if busy[j] is not None:
                        _wait(busy[j], deadline)
                    src = pack(bucket, tensors, bufs[j])
                work = pg.broadcast([src], self._opts(ep, deadline))
                if not bucket.whole:
                    busy[j] = work
                pending.append(work)
                while len(pending) > IN_FLIGHT:
                    _wait(pending.popleft(), deadline)
            while pending:
                _wait(pending.popleft(), deadline)
        except BaseException:
            pg = None  # the traceback keeps this frame alive; it must not keep the group alive
            self._fail()
            raise

    # -- receiver ------------------------------------------------------------------------------------------

    def receive(
        self, ep: Epoch, into: Mapping[str, torch.Tensor], deadline: Deadline, on_bucket: OnBucket = None
    ) -> None:
        pg = self._group(ep, deadline)
        try:
            free = list(self._staging(ep.plan, self._device(into)))
            pending: deque = deque()  # (bucket, work, flat, staged_buffer, copy_back)
            for bucket in ep.plan:
                # Post as deep as the sender does (IN_FLIGHT + 1 as it posts), so the next bucket is always posted
                # here when its bytes come: 100 MB decoder, 1 receiver, send 47 ms -> 44 (docs/weight_sync.md).
                while len(pending) > IN_FLIGHT or (not bucket.whole and not free):
                    free += self._finish(pending.popleft(), into, deadline, on_bucket)
                if bucket.whole:
                    flat, copy_back = whole_destination(bucket, into)
                    staged = None
                else:
                    staged = free.pop()
                    flat, copy_back = staged[: bucket.nbytes], True
                work = pg.broadcast([flat], self._opts(ep, deadline))
                pending.append((bucket, work, flat, staged, copy_back))
            while pending:
                self._finish(pending.popleft(), into, deadline, on_bucket)
        except BaseException:
            pg = None  # the traceback keeps this frame alive; it must not keep the group alive
            self._fail()
            raise

    def _finish(self, item, into, deadline: Deadline, on_bucket: OnBucket) -> list[torch.Tensor]:
        bucket, work, flat, staged, copy_back = item
        _wait(work, deadline)
        if copy_back:
            unpack(bucket, flat, into)
        if on_bucket is not None:
            on_bucket(bucket)
        return [staged] if staged is not None else []

    def close(self) -> None:
        self.end_epoch()
        self.buffers = []


def _wait(work, deadline: Deadline) -> None:
    # Work.wait raises on timeout and re-raises the op's own error (peer closed, gloo timeout).
    work.wait(deadline.timedelta())


def _drop(pg) -> None:
    # A finished group has no pending work; shutting it down releases its sockets now rather than at GC.
    try:
        pg.shutdown()
    except RuntimeError:
        pass


def abandon(pg) -> None:
    """Give up on a failed epoch's group without blocking the caller.

    Dropping a group whose worker threads are still inside an op joins those threads, which can take up to
    the op's timeout. So abort it, and let the last reference go on a daemon thread.
    """
    try:
        pg.abort()
    except RuntimeError:
        pass
    threading.Thread(target=lambda p=pg: p, daemon=True, name="weights-abandon").start()
