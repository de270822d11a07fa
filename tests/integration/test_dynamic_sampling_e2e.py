"""DAPO dynamic sampling through the whole system: replay drops groups whose rewards are all equal,
the controller leases new prompts for their step, and the trainer never sees a zero-variance group."""

from __future__ import annotations

import asyncio

import pytest

from services.common.config import load_config
from services.controller.client import ControllerClient
from services.local import LocalStack

pytestmark = pytest.mark.slow
STEPS = 12


def test_every_trained_group_has_differing_rewards_and_filtered_ones_are_refilled(tmp_path):
    cfg = load_config(None, [f"grpo.max_num_steps={STEPS}", "grpo.use_dynamic_sampling=true"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)

        async def status():
            client = ControllerClient(stack.cfg.addresses.controller, stack.cfg.controller.auth_token)
            try:
                return await client.status()
            finally:
                await client.close()

        refilled = asyncio.run(status()).releases
    assert len(rows) == STEPS
    assert all(r["train/advantages/zero_variance_group_fraction"] == 0.0 for r in rows), rows
    # The toy task starts near reward 0.03: most 16-sample groups score all zeros and are refilled.
    assert refilled > 0
