"""Entry point of the environment service: `flywheel serve environment`."""

from __future__ import annotations

import asyncio

from services.common.config import REWARD_MODEL, FlywheelConfig
from services.common.pb.flywheel.v1 import environment_pb2_grpc
from services.common.server import run_service
from services.common.telemetry import setup_telemetry
from services.environment.agents.service import AgentServicer
from services.environment.remote import RemoteEnvironment
from services.environment.server import EnvironmentServicer


async def serve(cfg: FlywheelConfig) -> None:
    setup_telemetry("environment", cfg.run.name, cfg.telemetry)
    reward_model = None
    if cfg.uses_reward_model:  # a server of the run: it takes the run's token, and may still be loading its model
        reward_model = RemoteEnvironment(REWARD_MODEL, cfg.addresses.reward_model, security=cfg.security,
                                         timeout_s=cfg.env.reward_model.timeout_s, wait_for_ready=True)
    servicer = EnvironmentServicer(settings=cfg.env.model_dump(), reward_model=reward_model)

    async def close_agents_at_stop(stop: asyncio.Event) -> None:
        """Agents run processes of their own (ng_run and its Ray cluster in their own session): stop them with
        the service, inside its stop grace, or they outlive it."""
        await stop.wait()
        await servicer.close_agents()

    await run_service("environment", cfg.addresses.environment,
                      lambda server: (environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server),
                                      environment_pb2_grpc.add_AgentServiceServicer_to_server(
                                          AgentServicer(servicer), server)),
                      close_agents_at_stop, security=cfg.security)
