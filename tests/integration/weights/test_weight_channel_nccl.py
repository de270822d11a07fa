"""nccl backend: the gloo code path with CUDA tensors and ProcessGroupNCCL. Needs two GPUs (NCCL refuses two
ranks on one device), so it is skipped on CPU machines and has not run in this repository's CI yet."""

from __future__ import annotations

import pytest
import torch

from services.common.weights import WeightSender
from weights_harness import make_state, outcomes, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_nccl_receiver_gets_bitwise_equal_weights_on_another_gpu():
    torch.cuda.set_device(0)
    sender = WeightSender(backend="nccl", bucket_bytes=4096)
    proc = spawn(sender.store_address, "w0", backend="nccl", device="cuda:1")
    state = {k: v.to("cuda:0") for k, v in make_state(5).items()}
    result = sender.sync(5, ["w0"], state, timeout_s=60)
    sender.close()
    assert result.members_ok == ["w0"]
    (got,) = [o for o in outcomes(proc, timeout=60) if o["event"] == "received"]
    assert got["equal"] and got["checksum"] == result.checksum
