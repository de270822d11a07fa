"""A controller killed at each point of its lease/save sequence, in seeded runs: no prompt leased twice, none lost.

The oracle is the work stream (lease_harness.py): every group the controller published, none consumed.
A prompt trained twice would first be a prompt leased into two groups there; a lost one, a gap in the
epoch's order. Each run walks STEPS steps; before each step a fault of SCHEDULE in a seeded order (none, a
SIGKILL at a random moment, a work stream that refuses the publish, a state bucket that refuses the lease
record), and half of the time a refill (replay's "filtered") in flight at the same moment.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from lease_harness import PER_STEP, ROWS, STEPS, Driver, config
from services.common.bus import Bus, state_bucket
from services.controller.data.plan import position
from services.local import LocalStack

pytestmark = pytest.mark.slow
SCHEDULE = ("none", "kill", "kill", "work_full", "work_full", "bucket_full", "bucket_full")
"""One fault before each step after the first (STEPS - 1 of them), in a seeded order."""


async def _step(d: Driver, rng: random.Random, fault: str, groups: list) -> None:
    """Opens step d.version + 1 (and maybe refills a group) under `fault`; restarts a controller that died."""
    streams = {"work_full": d.bus.subjects.stream("work"), "bucket_full": f"KV_{state_bucket(d.bus.subjects.run)}"}
    if fault in streams:
        await d.refuse_new(streams[fault], True)
    if groups and rng.random() < 0.5:
        await d.announce_filtered(rng.choice([g.group_id for g in groups if g.group_id not in d.filtered]))
    d.version += 1
    if fault == "none":
        return
    if fault == "kill":
        await asyncio.sleep(rng.uniform(0, 0.3))
        d.kill()
    else:
        assert await d.wait_exit() != 0
    d.points.append(await d.where())
    if fault in streams:
        await d.refuse_new(streams[fault], False)
    await d.start_controller()


async def _run(tmp_path, cfg, seed: int) -> tuple[list, Driver]:
    with LocalStack(cfg, tmp_path) as stack:
        bus = await Bus.connect(stack.cfg.addresses.nats_url, stack.cfg.run.name, security=stack.cfg.security)
        d = Driver(stack, bus)
        stack.children.start("environment", "environment", stack.config_path)
        await d.start_controller()
        beating = asyncio.create_task(d.heartbeats())
        rng = random.Random(seed)
        try:
            while len(await d.published()) < PER_STEP:  # step 0 leased: the stream exists, groups to refill
                assert d.proc.poll() is None, stack.children.tail("controller")
                await asyncio.sleep(0.2)
            for fault in rng.sample(SCHEDULE, len(SCHEDULE)):
                await _step(d, rng, fault, await d.published())
                await asyncio.sleep(rng.uniform(0, 1))
            groups = await d.settled()
        finally:
            beating.cancel()
            await bus.close()
    return groups, d


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_controller_killed_anywhere_in_its_lease_sequence_leases_each_prompt_once(tmp_path, seed):
    cfg = config(tmp_path)
    groups, d = asyncio.run(_run(tmp_path, cfg, seed))
    prompts = [g.prompt_id for g in groups]
    assert len(prompts) == len(set(prompts)), Counter(prompts).most_common(3)  # none leased twice
    epoch_order = {f"math/e{e}/{i}" for e, i in (position(k, ROWS, PER_STEP, cfg.run.seed, cfg.data.shuffle) for k in range(len(groups)))}
    assert set(prompts) == epoch_order  # none skipped: the first len(groups) prompts of the epoch
    trained = Counter(g.target_step for g in groups if g.group_id not in d.filtered)
    assert trained == {t: PER_STEP for t in range(STEPS)}
    assert {"saved, not published", "published, not recorded"} <= set(d.points), d.points  # both windows hit
    print(f"seed {seed}: {len(groups)} groups, {len(d.filtered)} refills, kills landed at {Counter(d.points)}")
