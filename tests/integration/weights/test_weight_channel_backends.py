"""Every backend available on this machine moves the same bytes and follows membership across epochs.

gloo, nixl (UCX over shared memory on CPU) and filesystem run here; nccl needs two GPUs (see
`test_weight_channel_nccl.py`). Receivers are separate processes (`weights_harness.py`).
"""

from __future__ import annotations

import pytest
from needs import require_module

from services.common.weights import WeightSender
from weights_harness import make_state, outcomes, signal_once_joined, spawn

BACKENDS = ["gloo", "nixl", "filesystem"]  # nixl: `make setup` installs it; without it the test skips (fails in CI)


@pytest.fixture(params=BACKENDS)
def sender(request, tmp_path):
    if request.param == "nixl":
        require_module("nixl")
    s = WeightSender(backend=request.param, bucket_bytes=4096, path=str(tmp_path / "weights"))
    yield s
    s.close()


def _received(proc) -> list[tuple[int, bool, str]]:
    return [(o["version"], o["equal"], o["checksum"]) for o in outcomes(proc) if o["event"] == "received"]


def test_receivers_get_bitwise_equal_weights(sender):
    backend = sender.backend.name
    procs = [spawn(sender.store_address, w, backend=backend) for w in ("w0", "w1")]
    result = sender.sync(7, ["w0", "w1"], make_state(7), timeout_s=15)
    assert (result.members_ok, result.members_dropped) == (["w0", "w1"], [])
    assert result.bytes == sum(t.numel() * t.element_size() for t in make_state(7).values())
    for proc in procs:
        assert _received(proc) == [(7, True, result.checksum)]


def test_membership_shrinks_and_grows_across_epochs(sender):
    backend = sender.backend.name
    a = spawn(sender.store_address, "a", backend=backend, versions=3)
    b = spawn(sender.store_address, "b", backend=backend, versions=2)
    results = [
        sender.sync(1, ["a", "b"], make_state(1), timeout_s=10),
        sender.sync(2, ["a"], make_state(2), timeout_s=10),
        sender.sync(3, ["b", "a"], make_state(3), timeout_s=10),
    ]
    assert [r.members_ok for r in results] == [["a", "b"], ["a"], ["b", "a"]]
    assert [r.epoch for r in results] == [1, 2, 3]
    assert [(v, eq) for v, eq, _ in _received(a)] == [(1, True), (2, True), (3, True)]
    assert [(v, eq) for v, eq, _ in _received(b)] == [(1, True), (3, True)]


def test_nixl_receiver_killed_mid_read_is_dropped_within_deadline():
    require_module("nixl")
    import signal
    import time

    sender = WeightSender(backend="nixl", bucket_bytes=4096)
    healthy = spawn(sender.store_address, "w0", backend="nixl")
    slow = spawn(sender.store_address, "w1", backend="nixl", sleep_per_bucket=1.0)
    signal_once_joined(sender, "w1", slow, signal.SIGKILL, after_s=0.5)  # it is unpacking, ~1 s per bucket
    start = time.monotonic()
    result = sender.sync(1, ["w0", "w1"], make_state(1), timeout_s=6)
    assert time.monotonic() - start < 6 + 5.0
    assert (result.members_ok, result.members_dropped) == (["w0"], ["w1"])
    assert [(v, eq) for v, eq, _ in _received(healthy)] == [(1, True)]
    slow.wait(timeout=5)
    sender.close()
