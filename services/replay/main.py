"""Replay service entry point: `serve(cfg)` wires Redis, NATS, ingest and the gRPC servicer.

    asyncio.run(serve(cfg))              # from services/cli.py
    python -m services.replay.main [--config FILE] [key=value ...]

SIGINT/SIGTERM (through run_service) stop ingest after its current fetch, then the gRPC
server drains; unacked messages simply stay in JetStream for the next start.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
from redis.asyncio import Redis

from services.common.bus import Bus
from services.common.config import FlywheelConfig, load_config
from services.common.logs import event, setup_logging
from services.common.server import run_service
from services.common.telemetry import setup_telemetry, shutdown_telemetry
from services.replay.ingest import Ingest
from services.replay.pulse import Pulse
from services.replay.reports import TrainerReports
from services.replay.server import SAMPLE_HOLD_S, ReplayServicer, RunShape, register
from services.replay.store import ReplayStore


@dataclass(kw_only=True, slots=True)
class Replay:
    """The parts of one replay service, connected."""

    store: ReplayStore
    ingest: Ingest
    reports: TrainerReports
    servicer: ReplayServicer

    def register(self, server: grpc.aio.Server) -> None:
        register(self.servicer, server)

    async def run(self, stop: asyncio.Event) -> None:
        """Ingest, the trainer's step reports and the stale outbox, until `stop` is set."""
        await asyncio.gather(self.ingest.run(stop), self.reports.run(stop), self.servicer.announce_stale_until(stop))


@asynccontextmanager
async def open_replay(cfg: FlywheelConfig) -> AsyncIterator[Replay]:
    """Connect to Redis and NATS and build the parts; closes both clients on exit."""
    async with AsyncExitStack() as stack:
        redis = Redis.from_url(cfg.addresses.redis_url, password=cfg.security.redis_password.get_secret_value() or None)
        stack.push_async_callback(redis.aclose)
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="replay", security=cfg.security)
        stack.push_async_callback(bus.close)
        store = ReplayStore(redis, cfg.run.name, tombstone_ttl_s=cfg.replay.tombstone_ttl_s)
        space = asyncio.Event()  # Sample -> ingest: buffer room was freed
        stored = Pulse()  # ingest -> Sample: new groups are in Redis
        reported = Pulse()  # step reports -> Commit: the trainer's progress moved
        run = RunShape(prompts_per_step=cfg.grpo.num_prompts_per_step, max_staleness=cfg.grpo.max_staleness)
        ingest = Ingest(bus, store, cfg.replay, space, drop_zero_variance=cfg.grpo.use_dynamic_sampling,
                        reward_scaling=cfg.grpo.reward_scaling, stored=stored)
        yield Replay(store=store, ingest=ingest, reports=TrainerReports(bus, store, reported),
                     servicer=ReplayServicer(store, bus, cfg.replay, space, run=run, stored=stored,
                                             reported=reported, hold_s=SAMPLE_HOLD_S))


async def serve(cfg: FlywheelConfig) -> None:
    """Run the replay service until SIGINT/SIGTERM."""
    log = setup_logging("replay", cfg.run.name, cfg.telemetry.log_level)
    setup_telemetry("replay", cfg.run.name, cfg.telemetry)
    try:
        async with open_replay(cfg) as replay:
            event(log, "replay starting", address=cfg.addresses.replay, capacity=cfg.replay.capacity_groups,
                  selection=cfg.replay.selection)
            await run_service("replay", cfg.addresses.replay, replay.register, replay.run,
                              security=cfg.security)
    finally:
        shutdown_telemetry()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.replay.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as replay.capacity_groups=64")
    args = parser.parse_args(argv)
    asyncio.run(serve(load_config(args.config, args.overrides)))


if __name__ == "__main__":
    main()
