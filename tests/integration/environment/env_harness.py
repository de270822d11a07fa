"""Helpers for the remote-environment tests: requests, a switchable faulty server, the example server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2

REPO = Path(__file__).resolve().parents[3]


def step_request(env_name: str, n: int, answer: str = "3") -> environment_pb2.StepRequest:
    """n episodes of "copy 3" answered with `answer`."""
    request = environment_pb2.StepRequest(env_name=env_name)
    for _ in range(n):
        episode = request.episodes.add(messages=[types_pb2.ChatMessage(role="user", content="copy 3"),
                                                 types_pb2.ChatMessage(role="assistant", content=answer)])
        episode.metadata.update({"ground_truth": "3"})
    return request


class FaultyEnvironment(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0

    async def Step(self, request, context):
        self.calls += 1
        n = len(request.episodes)
        if self.mode == "hang":
            await asyncio.sleep(30)
        if self.mode == "error":
            await context.abort(grpc.StatusCode.INTERNAL, "verifier exploded")
        if self.mode == "wrong_count":
            n -= 1
        reward = float("nan") if self.mode == "nan" else 1.0
        return environment_pb2.StepResponse(results=[environment_pb2.EpisodeResult(reward=reward, terminated=True)
                                                     for _ in range(n)])


@dataclass
class Remote:
    servicer: FaultyEnvironment
    address: str


def start_example_server(port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "remote_env_server.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.startswith("listening on "), f"example server said {line!r}"
    return proc, line.removeprefix("listening on ")
