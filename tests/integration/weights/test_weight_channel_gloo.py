"""Failure handling of the weight channel, over gloo between separate processes: dead, stalled, absent,
late and restarted members, and a model that does not match.

Receivers are real subprocesses (`weights_harness.py`) that learn of each epoch from the trainer's store.
"""

from __future__ import annotations

import signal
import time

import pytest

from services.common.weights import Announcement, ManifestMismatch, WeightReceiver, WeightSender
from services.common.weights.backends.collective import DEADLINES
from weights_harness import make_state, outcomes, signal_once_joined, spawn

BUCKET = 4096  # small buckets: many of them, so double buffering and mid-sync failures are exercised
SLACK_S = 5.0  # generous: the machine is shared; asserts only say "did not hang"


@pytest.fixture
def sender():
    s = WeightSender(backend="gloo", bucket_bytes=BUCKET)
    yield s
    s.close()


def _received(proc) -> list[dict]:
    return [o for o in outcomes(proc) if o["event"] == "received"]


def test_receiver_killed_mid_sync_is_dropped_and_the_next_sync_succeeds(sender):
    healthy = spawn(sender.store_address, "w0", versions=2)
    slow = spawn(sender.store_address, "w1", sleep_per_bucket=1.0)
    timeout_s = 10.0

    # 0.5 s in, it is inside the transfer: the slow receiver needs about 1 s per bucket.
    signal_once_joined(sender, "w1", slow, signal.SIGKILL, after_s=0.5)
    start = time.monotonic()
    result = sender.sync(1, ["w0", "w1"], make_state(1), timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + SLACK_S
    assert result.members_ok == ["w0"] and result.members_dropped == ["w1"]
    after = sender.sync(2, ["w0"], make_state(2), timeout_s=timeout_s)  # the trainer goes on with the live
    assert after.members_ok == ["w0"] and after.failures == 0
    assert [(o["version"], o["equal"]) for o in _received(healthy)] == [(1, True), (2, True)]
    slow.wait(timeout=5)


def test_under_nccls_deadline_rule_the_host_drops_a_stalled_receiver_and_the_next_sync_succeeds(sender):
    """nccl's rule over gloo (backends/collective.py): every group's own timeout is a minute past the sync's
    deadline, as NCCL's watchdog must be, so only the host-side poll and abort can end the stalled broadcast
    in time. A dead NCCL peer looks like this stall: the kernel waits, nothing errors. 200 small tensors put the
    20 MB one 12 buckets in, past what the member posted before it stopped, so the sender's own broadcast of
    it cannot complete (gloo sends only into a posted receive)."""
    sender.backend.deadlines = DEADLINES["nccl"]
    timeout_s, big, small = 8.0, 5_000_000, 200
    assert sender.backend.deadlines.group_timeout_s(timeout_s) > timeout_s + SLACK_S + 30
    healthy = spawn(sender.store_address, "w0", versions=2, deadlines="nccl", n_small=small, large_numel=big)
    stalled = spawn(sender.store_address, "w1", sleep_per_bucket=1.0, deadlines="nccl", n_small=small,
                    large_numel=big)
    signal_once_joined(sender, "w1", stalled, signal.SIGSTOP, after_s=0.3)  # alive, sockets open, never reads
    try:
        start = time.monotonic()
        result = sender.sync(1, ["w0", "w1"], make_state(1, n_small=small, large_numel=big), timeout_s=timeout_s)
        assert time.monotonic() - start < timeout_s + SLACK_S
        assert result.members_ok == ["w0"] and result.members_dropped == ["w1"]
        after = sender.sync(2, ["w0"], make_state(2, n_small=small, large_numel=big), timeout_s=timeout_s)
        assert after.members_ok == ["w0"] and after.failures == 0
        assert [(o["version"], o["equal"]) for o in _received(healthy)] == [(1, True), (2, True)]
    finally:
        stalled.kill()
        stalled.wait(timeout=5)


def test_stalled_receiver_is_dropped_without_hanging_the_sender(sender):
    healthy = spawn(sender.store_address, "w0")
    stalled = spawn(sender.store_address, "w1", sleep_per_bucket=1.0)
    timeout_s = 8.0

    signal_once_joined(sender, "w1", stalled, signal.SIGSTOP, after_s=0.3)  # alive, sockets open, never reads
    try:
        start = time.monotonic()
        result = sender.sync(1, ["w0", "w1"], make_state(1), timeout_s=timeout_s)
        assert time.monotonic() - start < timeout_s + SLACK_S
        assert result.members_ok == ["w0"] and result.members_dropped == ["w1"]
        assert [o["equal"] for o in _received(healthy)] == [True]
    finally:
        stalled.kill()
        stalled.wait(timeout=5)


def test_absent_member_is_dropped_and_the_others_get_the_version():
    sender = WeightSender(backend="gloo", bucket_bytes=BUCKET, join_timeout_s=3)
    proc = spawn(sender.store_address, "w0")
    result = sender.sync(3, ["w0", "ghost"], make_state(3), timeout_s=12)
    sender.close()
    assert (result.members_ok, result.members_dropped, result.attempts) == (["w0"], ["ghost"], 2)
    assert [o["equal"] for o in _received(proc)] == [True]
    # Phases add up over both attempts: the first waited out join_timeout_s for the ghost.
    assert set(result.phases) == {"announce", "join", "send", "confirm"} and result.phases["join"] >= 3
    assert sum(result.phases.values()) <= result.seconds


def test_an_announcement_that_fails_to_publish_does_not_fail_the_sync():
    """The trainer's NATS publish can time out on a loaded broker: the round goes on, and the receivers that
    learn of it from the store get the version."""
    def publish(_announcement) -> None:
        raise TimeoutError("nats: timeout")

    sender = WeightSender(backend="gloo", bucket_bytes=BUCKET, publish=publish)
    proc = spawn(sender.store_address, "w0")
    try:
        result = sender.sync(1, ["w0"], make_state(1), timeout_s=10)
    finally:
        sender.close()
    assert result.members_ok == ["w0"]
    assert [o["equal"] for o in _received(proc)] == [True]


def test_late_worker_receives_the_current_version_at_the_next_epoch(sender):
    early = spawn(sender.store_address, "w0", versions=2)
    first = sender.sync(1, ["w0"], make_state(1), timeout_s=10)
    late = spawn(sender.store_address, "late")
    second = sender.sync(1, ["w0", "late"], make_state(1), timeout_s=10)
    assert first.members_ok == ["w0"] and second.members_ok == ["w0", "late"]
    assert second.epoch > first.epoch
    assert [(o["version"], o["equal"]) for o in _received(late)] == [(1, True)]
    assert [o["equal"] for o in _received(early)] == [True, True]


def test_receiver_refuses_an_announcement_for_another_model(sender):
    ann = Announcement(version=1, epoch=1, manifest_digest="0" * 64, store_address=sender.store_address,
                       backend="gloo", members=["w0"])
    with pytest.raises(ManifestMismatch, match="manifest"):
        WeightReceiver("w0", "gloo").receive(ann.fields(), make_state(0), timeout_s=2)


def test_same_members_keep_their_epoch_and_a_restarted_worker_forces_a_new_one(sender):
    first = spawn(sender.store_address, "w0", versions=2)
    r1 = sender.sync(1, ["w0"], make_state(1), timeout_s=10)
    r2 = sender.sync(2, ["w0"], make_state(2), timeout_s=10)
    assert r1.epoch == r2.epoch and r2.attempts == 1  # the process group is reused
    assert [o["equal"] for o in _received(first)] == [True, True]
    restarted = spawn(sender.store_address, "w0")  # same id, new process: it holds no group for that epoch
    r3 = sender.sync(3, ["w0"], make_state(3), timeout_s=10)
    assert r3.members_ok == ["w0"] and r3.epoch > r2.epoch and r3.attempts == 2
    assert [(o["version"], o["equal"]) for o in _received(restarted)] == [(3, True)]
