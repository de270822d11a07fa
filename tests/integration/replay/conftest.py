"""Replay integration fixtures: a config pointing at the test's NATS and Redis, an in-process
replay (ingest task + gRPC server with the shared error mapping), a publisher bus."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "replay"))  # groups.py, shared with the unit tests

from services.common.bus import Bus  # noqa: E402
from services.common.config import FlywheelConfig  # noqa: E402
from services.common.pb.flywheel.v1 import replay_pb2_grpc, types_pb2  # noqa: E402
from services.common.server import ErrorInterceptor  # noqa: E402
from services.replay.main import Replay, open_replay  # noqa: E402


@pytest.fixture
def cfg(nats_server, redis_server) -> FlywheelConfig:
    return FlywheelConfig.model_validate({
        "run": {"name": f"t-{uuid.uuid4().hex[:8]}"},
        "addresses": {"nats_url": nats_server.url, "redis_url": redis_server.url},
        "replay": {"ack_wait_s": 1.0},
        "environments": [{"name": "toy", "kind": "toy_copy"}],
    })


@pytest.fixture
async def bus(cfg) -> AsyncIterator[Bus]:
    publisher = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="test")
    yield publisher
    await publisher.close()


@asynccontextmanager
async def running_replay(cfg: FlywheelConfig) -> AsyncIterator[tuple[Replay, replay_pb2_grpc.ReplayServiceStub]]:
    """The replay parts serve() runs (ingest, step reports, gRPC), in this process, without its signal handlers."""
    async with open_replay(cfg) as replay:
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        replay.register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = asyncio.Event()
        ingest = asyncio.create_task(replay.run(stop))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield replay, replay_pb2_grpc.ReplayServiceStub(channel)
        finally:
            stop.set()
            await ingest
            await channel.close()
            await server.stop(0)


async def until(predicate: Callable, what: str, timeout_s: float = 30.0) -> None:
    """Poll an async predicate; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def with_grpo(cfg: FlywheelConfig, *, num_prompts_per_step: int, max_staleness: int) -> FlywheelConfig:
    """`cfg` whose trainer asks replay for batches of another shape (prompts per step, staleness k)."""
    tree = cfg.model_dump(mode="json")
    tree["grpo"]["num_prompts_per_step"] = num_prompts_per_step
    tree["grpo"]["async_grpo"] = {"enabled": max_staleness > 0, "max_trajectory_age_steps": max(1, max_staleness)}
    return FlywheelConfig.model_validate(tree)


async def report(bus: Bus, replay: Replay, step: int, checkpoint_step: int | None = None) -> None:
    """Send the trainer's StepReport until replay has recorded it (core NATS: one sent before replay
    subscribed is gone; a repeated report changes nothing)."""

    async def recorded() -> bool:
        await bus.emit(bus.subjects.train_step, types_pb2.StepReport(step=step, checkpoint_step=checkpoint_step))
        await asyncio.sleep(0.05)
        reached, checkpointed = await replay.store.trainer_progress()
        return reached >= step and (checkpoint_step is None or checkpointed >= checkpoint_step)

    await until(recorded, f"replay to record the report of step {step}")
