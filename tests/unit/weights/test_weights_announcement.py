"""Announcement <-> WeightAnnouncement proto, round ordering, deadlines and metrics: no network."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from services.common.pb.flywheel.v1 import types_pb2
from services.common.weights import metrics
from services.common.weights.rendezvous import Announcement, Deadline, split_address


def _ann(**kw) -> Announcement:
    base = dict(version=3, epoch=2, manifest_digest="ab" * 32, store_address="10.0.0.5:29500", backend="gloo",
                members=["w0", "w1"], path="")
    return Announcement(**{**base, **kw})


def test_announcement_round_trips_through_the_proto_message():
    ann = _ann(path="/shared/weights")
    msg = types_pb2.WeightAnnouncement(**ann.fields())
    assert Announcement.parse(msg) == ann
    assert Announcement.parse(ann.fields()) == ann


def test_rounds_order_by_epoch_then_version():
    assert _ann(epoch=2, version=4).order > _ann(epoch=2, version=3).order  # next version, same group
    assert _ann(epoch=3, version=3).order > _ann(epoch=2, version=9).order  # a retry is a new epoch


def test_split_address_handles_ipv6_brackets():
    assert split_address("[::1]:1234") == ("::1", 1234)
    assert split_address("host:80") == ("host", 80)


def test_deadline_sooner_never_extends():
    outer = Deadline(0.05)
    assert outer.sooner(10).at == outer.at
    time.sleep(0.06)
    assert outer.expired and outer.left() == 0.0


def test_metrics_record_counts_bytes_per_confirmed_member_and_failures():
    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = value("weight_sync_bytes_total", backend="test"), value("weight_sync_failures_total", backend="test")
    metrics.record(backend="test", seconds=0.5, nbytes=100, ok=2, dropped=1, failures=1)
    assert value("weight_sync_bytes_total", backend="test") - before[0] == 200
    assert value("weight_sync_failures_total", backend="test") - before[1] == 1
    assert value("weight_sync_members", backend="test", outcome="dropped") == 1


def test_sync_with_no_members_returns_at_once_with_the_checksum():
    import torch

    from services.common.weights import WeightSender, checksum

    sender = WeightSender(backend="gloo")
    state = {"w": torch.arange(10.0)}
    result = sender.sync(1, [], state, timeout_s=5)
    sender.close()
    assert (result.members_ok, result.members_dropped, result.attempts) == ([], [], 0)
    assert result.checksum == checksum(state.values())  # one tensor: plan order is manifest order
