"""The trainer's per-step timeline, read off the groups' wall-clock stamps (pure)."""

from __future__ import annotations

import pytest

from services.common.pb.flywheel.v1 import types_pb2
from services.trainer.main import group_timeline

S = 1_000_000_000


def test_lease_delay_rollout_span_and_ingest_come_from_the_first_lease_and_the_last_finish():
    groups = [types_pb2.TrajectoryGroup(leased_at_unix_ns=10 * S + S // 10, finished_at_unix_ns=10 * S + S // 2),
              types_pb2.TrajectoryGroup(leased_at_unix_ns=10 * S + S // 5, finished_at_unix_ns=10 * S + 3 * S // 5)]
    timeline = group_timeline(groups, synced_at_ns=10 * S, sample_returned_ns=11 * S)
    assert timeline == pytest.approx({"timing/train/lease_delay": 0.1, "timing/train/rollout_span": 0.5,
                                      "timing/train/ingest": 0.4})


def test_no_groups_no_timeline_and_no_sync_yet_no_lease_delay():
    assert group_timeline([], 1, 2) == {}
    group = types_pb2.TrajectoryGroup(leased_at_unix_ns=S, finished_at_unix_ns=2 * S)
    assert group_timeline([group], 0, 3 * S)["timing/train/lease_delay"] == 0.0
