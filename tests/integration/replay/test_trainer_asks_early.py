"""With k >= 1 the trainer asks replay for the next step's batch while a step trains, and the next step uses
that answer; with k = 0 it never asks early (that batch needs the weights the step makes). Real replay, NATS
and Redis in process; the trainer's sampling half only (no model)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from conftest import running_replay, with_grpo
from groups import make_group
from services.common.pb.flywheel.v1 import replay_pb2
from services.trainer.main import Trainer


async def _trainer(cfg, stub) -> Trainer:
    trainer = Trainer(cfg, SimpleNamespace(target=None), bus=None, sender=None)
    trainer.replay = stub
    return trainer


async def _fill(bus, replay, n: int) -> None:
    for i in range(n):
        await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", 0))
    while (await replay.store.stats()).size < n:
        await asyncio.sleep(0.02)


async def test_the_next_batch_is_asked_for_once_during_the_step_and_used(cfg, bus):
    run_cfg = with_grpo(cfg, num_prompts_per_step=2, max_staleness=1)
    async with running_replay(run_cfg) as (replay, stub):
        await _fill(bus, replay, 4)
        trainer = await _trainer(run_cfg, stub)
        stop = asyncio.Event()
        first, _, _ = await trainer._sample(0, stop)
        trainer._ask_early(1)  # as _step does once it has step 0's batch
        assert trainer.early is not None and trainer.early[0] == 1
        await trainer.early[1]
        assert (await replay.store.stats()).size == 0  # step 1's batch is chosen and recorded already
        second, waited, _ = await trainer._sample(1, stop)
        assert waited == 0.0 and trainer.early is None
        recorded = await stub.Sample(replay_pb2.SampleRequest(step=1, prompts_per_step=2, max_staleness=1))
        assert second == recorded and {g.group_id for g in first.groups}.isdisjoint(g.group_id for g in second.groups)


async def test_a_synchronous_run_never_asks_early(cfg, bus):
    run_cfg = with_grpo(cfg, num_prompts_per_step=2, max_staleness=0)
    async with running_replay(run_cfg) as (replay, stub):
        trainer = await _trainer(run_cfg, stub)
        trainer._ask_early(1)
        assert trainer.early is None
