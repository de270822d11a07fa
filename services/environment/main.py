"""Entry point of the environment service: `flywheel serve environment`."""

from __future__ import annotations

from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import environment_pb2_grpc
from services.common.server import run_service
from services.common.telemetry import setup_telemetry
from services.environment.server import EnvironmentServicer


async def serve(cfg: FlywheelConfig) -> None:
    setup_telemetry("environment", cfg.run.name, cfg.telemetry)
    servicer = EnvironmentServicer(settings=cfg.env.model_dump())
    await run_service("environment", cfg.addresses.environment,
                      lambda server: environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server),
                      security=cfg.security)
