"""Forwarding to a remote environment server that speaks EnvironmentService.

Each call has a deadline and is retried with exponential back-off; after
`BREAKER_FAILURES` failed calls in a row the circuit opens for `BREAKER_OPEN_S`, during
which episodes fail at once instead of waiting on a dead server. A crash, a hang or a
garbage answer scores that batch's episodes as failed (with the reason), never the run.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf import json_format
from prometheus_client import Counter

from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc
from services.common.server import channel
from services.environment.base import StepResult

log = logging.getLogger("flywheel.environment.remote")
RETRIES = 2
BACKOFF_S = 0.2
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 10.0
REMOTE_FAILURES = Counter("flywheel_remote_env_failures_total", "Remote environment calls that failed",
                          ["env", "reason"])


class RemoteEnvironment:
    def __init__(self, name: str, address: str, *, timeout_s: float) -> None:
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self._stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._failures = 0
        self._open_until = 0.0

    async def check_reachable(self, timeout_s: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise InvalidArgument(f"environment {self.name!r}: {self.address} is unreachable") from None

    async def step(self, request: environment_pb2.StepRequest):
        """Results aligned with request.episodes; failures become failed results."""
        n = len(request.episodes)
        forwarded = environment_pb2.StepRequest()
        forwarded.CopyFrom(request)
        try:
            response = await self._call(forwarded)
            if len(response.results) != n:
                raise ValueError(f"returned {len(response.results)} results for {n} episodes")
        except Exception as err:
            reason = _reason(err)
            REMOTE_FAILURES.labels(self.name, reason.split(":")[0]).inc()
            log.warning("remote environment %s failed: %s", self.name, reason)
            return [StepResult.failed(f"remote {self.name}: {reason}") for _ in range(n)]
        return [_decode(r) for r in response.results]

    async def prompts(self, request):
        return await self._call(request, rpc="Prompts")

    async def _call(self, request, rpc: str = "Step"):
        if time.monotonic() < self._open_until:
            raise ConnectionError("circuit open")
        for attempt in range(RETRIES + 1):
            try:
                response = await getattr(self._stub, rpc)(request, timeout=self.timeout_s)
                self._failures = 0
                return response
            except grpc.aio.AioRpcError as err:
                retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retryable or attempt == RETRIES:
                    self._record_failure()
                    raise
                await asyncio.sleep(BACKOFF_S * 2**attempt)

    def _record_failure(self) -> None:
        self._failures += 1
        if self._failures >= BREAKER_FAILURES:
            self._open_until = time.monotonic() + BREAKER_OPEN_S

    async def close(self) -> None:
        await self._channel.close()


def _reason(err: Exception) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


def _decode(r: environment_pb2.EpisodeResult) -> StepResult:
    return StepResult(observation=r.observation.content, reward=r.reward, named_rewards=dict(r.named_rewards),
                      terminated=r.terminated, next_stop_strings=list(r.next_stop_strings) or None,
                      metadata=json_format.MessageToDict(r.metadata) if r.HasField("metadata") else None,
                      answer=r.answer or None, error=r.error)
