"""The weight channel's deadlines for nccl: the host gives up and aborts before the group's own timeout.

NCCL itself cannot run here (no GPU); these drive the same code with gloo groups in one process: the timeout
arithmetic (pure), the re-arming of a reused group's timeout, and the host-side poll on a real pending op.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import HashStore, ProcessGroupGloo

from services.common.weights.backends import Epoch
from services.common.weights.backends.collective import DEADLINES, CollectiveBackend, _poll
from services.common.weights.rendezvous import Deadline

NCCL, GLOO = DEADLINES["nccl"], DEADLINES["gloo"]


@pytest.mark.parametrize("deadline_s", [0.05, 1.0, 60.0, 3600.0])
def test_the_nccl_group_times_out_a_margin_after_the_channels_deadline(deadline_s):
    # The watchdog acts at the group's timeout, counted from each op's start (after the round's start): it must
    # come well after the host's deadline, or TORCH_NCCL_ASYNC_ERROR_HANDLING takes the trainer down first.
    assert NCCL.group_timeout_s(deadline_s) >= deadline_s + 30
    assert NCCL.host_poll
    # gloo never takes the process down: its timeout stays the deadline, as it always was.
    assert GLOO.group_timeout_s(deadline_s) == deadline_s and not GLOO.host_poll


def _epoch(store, collective_timeout_s: float, new_group: bool) -> Epoch:
    return Epoch(group_store=store, store=store, epoch=1, version=1, rank=0, world_size=1, plan=[],
                 host="127.0.0.1", collective_timeout_s=collective_timeout_s, new_group=new_group)


def test_a_reused_group_is_rearmed_with_each_rounds_deadline():
    backend = CollectiveBackend("gloo")
    backend.deadlines = NCCL  # nccl's rule on a gloo group: the group's timeout is what it sets
    store = HashStore()
    pg = backend._group(_epoch(store, 5.0, new_group=True), Deadline(100))
    assert pg.options._timeout == timedelta(seconds=NCCL.group_timeout_s(5.0))
    # The next version for the same members keeps the group; its round may have a longer deadline.
    assert backend._group(_epoch(store, 40.0, new_group=False), Deadline(100)) is pg
    assert pg.options._timeout == timedelta(seconds=NCCL.group_timeout_s(40.0))
    backend.close()


def _pair(timeout_s: float) -> list[ProcessGroupGloo]:
    """Ranks 0 and 1 of one gloo group in this process (each constructor waits for the other)."""
    store, groups = HashStore(), [None, None]

    def make(rank: int) -> None:
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timedelta(seconds=timeout_s)
        groups[rank] = ProcessGroupGloo(store, rank, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_the_host_poll_gives_up_at_the_deadline_while_the_op_is_still_pending():
    root, member = _pair(timeout_s=60)
    got = torch.zeros(1000)
    work = member.broadcast([got])  # the root has not sent: nothing can complete this op yet
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        _poll(work, Deadline(0.3))
    assert time.monotonic() - start < 30  # the host's deadline ended it, not the group's own 60 s
    assert not work.is_completed()  # and the op was left as it was (nccl: for the group's abort)
    root.broadcast([torch.arange(1000.0)])
    _poll(work, Deadline(30))  # once the data comes, the same wait returns it
    assert torch.equal(got, torch.arange(1000.0))
