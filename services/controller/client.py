"""A small Python client for the controller's admin API, and the `flywheel env` / `flywheel status` commands.

    client = ControllerClient("127.0.0.1:50051", token="...")
    await client.submit(controller_pb2.EnvironmentSpec(name="calc", address="127.0.0.1:7000", rows=[...]))
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from google.protobuf import json_format

from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc
from services.common.server import channel


class ControllerClient:
    def __init__(self, address: str, token: str = "", timeout_s: float = 30.0) -> None:
        self._channel = channel(address)
        self.stub = controller_pb2_grpc.ControllerServiceStub(self._channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s

    async def submit(self, spec: controller_pb2.EnvironmentSpec) -> controller_pb2.SubmitEnvironmentResponse:
        return await self.stub.SubmitEnvironment(controller_pb2.SubmitEnvironmentRequest(spec=spec),
                                                 metadata=self.metadata, timeout=self.timeout_s)

    async def list(self) -> list[controller_pb2.EnvironmentStatus]:
        response = await self.stub.ListEnvironments(controller_pb2.ListEnvironmentsRequest(),
                                                    metadata=self.metadata, timeout=self.timeout_s)
        return list(response.environments)

    async def remove(self, name: str) -> None:
        await self.stub.RemoveEnvironment(controller_pb2.RemoveEnvironmentRequest(name=name),
                                          metadata=self.metadata, timeout=self.timeout_s)

    async def status(self) -> controller_pb2.StatusResponse:
        return await self.stub.Status(controller_pb2.StatusRequest(), metadata=self.metadata, timeout=self.timeout_s)

    async def close(self) -> None:
        await self._channel.close()


async def _env(args) -> None:
    client = ControllerClient(args.controller, args.token)
    try:
        if args.action == "submit":
            spec = controller_pb2.EnvironmentSpec(name=args.name, kind=args.kind, address=args.address,
                                                  jsonl_path=args.jsonl, weight=args.weight, max_turns=args.max_turns)
            response = await client.submit(spec)
            print(f"submitted {args.name} ({response.num_prompts or 'generated'} prompts)")
        elif args.action == "list":
            for env in await client.list():
                print(f"{env.spec.name:<24} weight {env.spec.weight:<6g} leased {env.leased_groups:<8} "
                      f"{env.spec.kind or env.spec.address}")
        else:
            await client.remove(args.name)
            print(f"removed {args.name}")
    finally:
        await client.close()


def env_command(args) -> int:
    try:
        asyncio.run(_env(args))
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0


def status_command(args) -> int:
    async def go():
        client = ControllerClient(args.controller, args.token)
        try:
            print(json_format.MessageToJson(await client.status(), always_print_fields_with_no_presence=True))
        finally:
            await client.close()

    try:
        asyncio.run(go())
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0
