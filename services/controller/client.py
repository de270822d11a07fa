"""A small Python client for the controller's admin API, and the `flywheel env` / `flywheel status` commands.

Both commands find the local run by themselves (discovery.py) unless --controller is given.

    client = ControllerClient("127.0.0.1:50051", token="...")
    await client.submit(controller_pb2.EnvironmentSpec(name="calc", address="127.0.0.1:7000", rows=[...]))
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc
from services.common.config import SecurityConfig
from services.common.jsonl import read_rows
from services.common.server import channel
from services.common.structs import to_struct
from services.controller.discovery import LocalRun, RunNotFound, find_local_run


class ControllerClient:
    def __init__(self, address: str, token: str = "", timeout_s: float = 30.0,
                 tls: SecurityConfig | None = None) -> None:
        """`tls`: the run's TLS settings where the controller serves TLS (LocalRun.tls)."""
        self.address = address
        self._channel = channel(address, security=tls)
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


async def _connect(args) -> tuple[ControllerClient, LocalRun | None]:
    """--controller as given (TLS with --tls-ca, mutual with --tls-cert/--tls-key), else the local run found
    by discovery (its address, admin token and TLS settings)."""
    if args.controller:
        tls = SecurityConfig(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                             tls_mutual=bool(args.tls_cert)) if args.tls_ca else None
        return ControllerClient(args.controller, args.token, tls=tls), None
    run = await find_local_run(args.run_dir)
    return ControllerClient(run.controller, args.token or run.token, tls=run.tls), run


async def _env(args) -> None:
    client, _ = await _connect(args)
    try:
        if args.action == "submit":
            spec = controller_pb2.EnvironmentSpec(
                name=args.name, kind=args.kind or ("agent" if args.agent else ""), address=args.address,
                jsonl_path=args.jsonl, weight=args.weight, max_turns=args.max_turns, timeout_seconds=args.timeout,
                agent=to_struct(json.loads(args.agent)) if args.agent else None)
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


def _run_command(go) -> int:
    try:
        asyncio.run(go)
    except grpc.aio.AioRpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except RunNotFound as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def env_command(args) -> int:
    return _run_command(_env(args))


async def _status(args) -> None:
    client, run = await _connect(args)
    try:
        status, envs = await client.status(), await client.list()
    finally:
        await client.close()
    if args.json:
        print(json_format.MessageToJson(status, always_print_fields_with_no_presence=True))
        return
    run_dir = run.run_dir if run else (Path(args.run_dir) if args.run_dir else None)
    print(format_status(status, envs, run_dir, client.address))


def status_command(args) -> int:
    return _run_command(_status(args))


def format_status(status: controller_pb2.StatusResponse, envs: list[controller_pb2.EnvironmentStatus],
                  run_dir: Path | None, address: str) -> str:
    """A person's view of the run: where it is, how training goes, what it draws from."""
    state = "finished" if status.done else "running"
    lines = [f"run {state}: controller {address}" + (f", run dir {run_dir}" if run_dir else ""),
             f"  steps trained {status.trained_step + 1}; rollout serves version {status.loaded_version} "
             f"({len(status.rollout_workers)} worker{'s' * (len(status.rollout_workers) != 1)}); "
             f"leasing for step {status.next_target_step}",
             f"  groups leased and not yet trained: {status.outstanding_groups}; leased again after going stale: "
             f"{status.releases}"]
    rows = read_rows(run_dir / "metrics.jsonl") if run_dir else []
    if rows:
        m = rows[-1]
        lines.append(f"  last step {m['step'] + 1}: reward {m.get('train/reward', m.get('train/reward_mean', 0)):.3f}, "
                     f"trajectory age {m.get('train/avg_trajectory_age', 0):.2f}, "
                     f"step time {m.get('timing/train/total_step_time', 0):.2f} s")
    val = read_rows(run_dir / "validation.jsonl") if run_dir else []
    if val:
        v = val[-1]
        extra = " ".join(f"{k.split('/')[1]} {x:.3f}" for k, x in v.items() if k.startswith("validation/pass@"))
        lines.append(f"  validation at version {v['version']}: accuracy {v['validation/accuracy']:.3f} {extra}".rstrip())
    for env in envs:
        lines.append(f"  environment {env.spec.name}: weight {env.spec.weight:g}, {env.leased_groups} groups leased "
                     f"({env.spec.kind or env.spec.address})")
    return "\n".join(lines)
