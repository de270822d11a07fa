"""The environment service in the test's own process: the real servicer and error mapping, on loopback."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.pb.flywheel.v1 import environment_pb2_grpc
from services.common.server import ErrorInterceptor
from services.environment.agents.service import AgentServicer
from services.environment.server import EnvironmentServicer


async def serve_environment(port: int = 0, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
                            ) -> tuple[grpc.aio.Server, int]:
    """An environment service (and its AgentService) with nothing registered, on `port` (a free one for 0);
    `interceptors` run first."""
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()])
    servicer = EnvironmentServicer()
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    environment_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(servicer), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port
