"""The comparison every loss's parity test makes: (loss, gradient, metrics) against its float64 reference."""

from __future__ import annotations

import pytest
import torch


def assert_matches(got, want, what=""):
    """`got` and `want` are (loss, gradient, metrics); equal to 1e-6 relative."""
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = got, want
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-9,
                               msg=lambda m: f"{what} {m}")
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"{what} grad {m}")
    assert metrics == pytest.approx(ref_metrics, rel=1e-6, abs=1e-9), what
