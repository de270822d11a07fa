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

Deadlines (`GroupDeadlines`): the channel's deadline is enforced on the host, and the group's own timeout is
only a backstop. gloo's bounded `Work.wait` just raises, so gloo waits that way with its group's timeout equal
to the deadline. NCCL is different: its watchdog thread times every op out after the GROUP's timeout (a
BroadcastOptions timeout is ignored) and, with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (the Slurm scripts) or the
default 3, takes the whole process down; NCCL's own bounded `Work.wait` marks the op failed on expiry, which the
watchdog then acts on too. So for nccl the group's timeout is the round's deadline plus `margin_s`, re-armed
every round; the host polls `Work.is_completed()` until the deadline and, on expiry, aborts the group
(`ProcessGroupNCCL.abort()`: stops its watchdog, then aborts the communicators, which frees the spinning
kernel), and the channel drops the member as it does for gloo. The nccl path has NOT run on a GPU here
(no GPU on the machine that built it): it follows torch's ProcessGroupNCCL source, and tests drive the same
host-side code over gloo with nccl's rule (tests/integration/weights/test_weight_channel_gloo.py). Not
covered: NCCL communicator init, which is lazy (the first broadcast) and blocking, so a member that dies
between joining and that init can still hold the host in ncclCommInitRank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions

from services.common.weights.backends import Backend, Epoch, OnBucket
from services.common.weights.manifest import Bucket
from services.common.weights.packing import new_buffer, pack, unpack, whole_destination, whole_source
from services.common.weights.rendezvous import Deadline, poll_intervals

IN_FLIGHT = 2
ABORT_WAIT_S = 10.0
"""How long a failed epoch waits for its group's abort to return before going on without it (see `abandon`)."""
WAIT_POLL_S = 0.001
"""Longest sleep between two `is_completed()` polls: adds at most this to a transfer's wait."""


@dataclass(frozen=True, slots=True)
class GroupDeadlines:
    """How one backend keeps its collectives inside the channel's deadline (module docstring)."""

    margin_s: float
    """The group's own timeout is the round's deadline plus this: room for the host to give up and abort first."""
    host_poll: bool
    """Wait by polling `Work.is_completed()` on the host (nccl), not with the op's own bounded wait (gloo)."""

    def group_timeout_s(self, deadline_s: float) -> float:
        """The process group's timeout for a round whose collectives must end within `deadline_s`. Its ops
        start after the round does, so their own clocks expire `margin_s` after the host's deadline at least."""
        return deadline_s + self.margin_s


DEADLINES = {"gloo": GroupDeadlines(margin_s=0.0, host_poll=False),
             # 60 s: the host notices within WAIT_POLL_S, and abort() itself usually takes well under a second.
             "nccl": GroupDeadlines(margin_s=60.0, host_poll=True)}


class CollectiveBackend(Backend):
    # gloo on loopback: a broadcast costs ~0.4 ms on top of its bytes, about what packing 1 MiB costs (copy in,
    # copy out); benchmarks/weight_sync.py, decoder layout. NCCL's fixed cost is far smaller, but so is a copy.
    whole_bytes = 1 << 20

    def __init__(self, name: str):
        if name not in ("gloo", "nccl"):
            raise ValueError(name)
        self.name = name
        self.deadlines = DEADLINES[name]
        self.buffers: list[torch.Tensor] = []
        self.group: tuple[int, object] | None = None  # (epoch, process group) of the live epoch

    # -- group ---------------------------------------------------------------------------------------------

    def _group(self, ep: Epoch, deadline: Deadline):
        """The epoch's group: built on its first round, then reused while the epoch lives, its timeout re-armed
        for each round's deadline."""
        if not ep.new_group:
            if self.group is None or self.group[0] != ep.epoch:
                # E.g. a restarted receiver announced into a running epoch: it cannot join that group.
                raise RuntimeError(f"no live process group for epoch {ep.epoch}")
            pg = self.group[1]
            pg._set_default_timeout(self._timeout(ep, deadline))  # nccl times ops out by the group's timeout
            return pg
        self.end_epoch()
        pg = self._new_group(ep, deadline)
        self.group = (ep.epoch, pg)
        return pg

    def _timeout(self, ep: Epoch, deadline: Deadline) -> timedelta:
        """The group's (and each op's) own timeout this round: the round's deadline plus the backend's margin."""
        left = min(ep.collective_timeout_s, max(0.05, deadline.left()))
        return timedelta(seconds=self.deadlines.group_timeout_s(left))

    def _new_group(self, ep: Epoch, deadline: Deadline):
        timeout = self._timeout(ep, deadline)
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
            held = [self.group[1]]
            self.group = None
            abandon(held)

    def _opts(self, ep: Epoch, deadline: Deadline) -> BroadcastOptions:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self._timeout(ep, deadline)
        return opts

    def _device(self, tensors: Mapping[str, torch.Tensor]) -> torch.device:
        if self.name == "gloo":
            return torch.device("cpu")
        return next(iter(tensors.values())).device

    def _wait(self, work, deadline: Deadline) -> None:
        (_poll if self.deadlines.host_poll else _bounded_wait)(work, deadline)

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
                        self._wait(busy[j], deadline)
                    src = pack(bucket, tensors, bufs[j])
                work = pg.broadcast([src], self._opts(ep, deadline))
                if not bucket.whole:
                    busy[j] = work
                pending.append(work)
                while len(pending) > IN_FLIGHT:
                    self._wait(pending.popleft(), deadline)
            while pending:
                self._wait(pending.popleft(), deadline)
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
        self._wait(work, deadline)
        if copy_back:
            unpack(bucket, flat, into)
        if on_bucket is not None:
            on_bucket(bucket)
        return [staged] if staged is not None else []

    def close(self) -> None:
        self.end_epoch()
        self.buffers = []


def _bounded_wait(work, deadline: Deadline) -> None:
    # gloo: Work.wait raises on timeout and re-raises the op's own error (peer closed, gloo timeout).
    work.wait(deadline.timedelta())


def _poll(work, deadline: Deadline) -> None:
    """Wait for `work` on the host until `deadline`, then raise TimeoutError, leaving the op untouched for
    `abandon` (nccl: its own bounded wait would mark the op failed, and the watchdog would act on that)."""
    for sleep in poll_intervals(WAIT_POLL_S):
        if work.is_completed():
            work.wait()  # re-raises the op's error; nccl: orders the current stream after the op
            return
        if deadline.expired:
            raise TimeoutError("weight-channel collective did not complete by the channel's deadline")
        time.sleep(sleep)


def _drop(pg) -> None:
    # A finished group has no pending work; shutting it down releases its sockets now rather than at GC.
    try:
        pg.shutdown()
    except RuntimeError:
        pass


def abandon(held: list) -> None:
    """Give up on a failed epoch's group, `held` as the only reference to it, without blocking the caller past
    ABORT_WAIT_S.

    nccl: `abort()` first stops the group's watchdog (so it cannot tear the process down), then aborts its
    communicators; it waits on that for up to the group's timeout, so it runs on a daemon thread and the caller
    waits ABORT_WAIT_S at most, so the next epoch's group is normally built after the old one is gone.
    gloo: `abort()` does nothing, and dropping a group whose worker threads are still inside an op joins them,
    which can take up to the op's timeout; so the last reference goes on that daemon thread as well.
    """
    aborted = threading.Event()

    def run() -> None:
        pg = held.pop()  # from here this thread holds the only reference, so the group is dropped here
        try:
            pg.abort()
        except RuntimeError:
            pass
        aborted.set()

    threading.Thread(target=run, daemon=True, name="weights-abandon").start()
    aborted.wait(ABORT_WAIT_S)
