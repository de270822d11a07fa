"""Forwarding to a remote environment server that speaks EnvironmentService.

Failure semantics, per `step` call (one batch of episodes of one environment):

- deadline: each attempt has `timeout_s`, and all attempts together stay inside the
  caller's own deadline (`budget_s`, less a margin to answer it);
- retries: UNAVAILABLE and DEADLINE_EXCEEDED are retried `retries` times with exponential
  back-off (`backoff_s`, doubled each time); other status codes are not;
- circuit breaker: after `breaker_failures` failed calls in a row the circuit opens for
  `breaker_open_s`, and calls fail at once instead of waiting on a dead server; the
  first call after that is a probe that closes it again on success;
- a crash, a hang, an error status or a garbage answer (a wrong number of results, a non-finite
  reward) fails the whole call with `Unavailable`: the environment service answers UNAVAILABLE, and
  rollout hands the group back to run it again later. No episode is scored from a call that gave no
  usable answer, so an outage never trains as zero rewards. The failure is counted in
  `flywheel_remote_env_failures_total{env,reason}` and recorded on the current OpenTelemetry span.
  An episode the remote itself answers with `error` set is the remote's verdict and is kept.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from services.common.config import SecurityConfig
from services.common.errors import InvalidArgument, Unavailable
from services.common.messages import message_to_dict
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc
from services.common.server import channel
from services.common.structs import from_struct
from services.environment.base import StepResult

log = logging.getLogger("flywheel.environment.remote")
DEFAULT_TIMEOUT_S = 10.0
RETRIES = 2
BACKOFF_S = 0.2
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 10.0
MARGIN_S = 0.25
"""Seconds of the caller's deadline kept back to send it the failed results."""
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A restarted remote is found within seconds, not after gRPC's default 2-minute reconnect back-off.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]

FAILED_CALLS = Counter("flywheel_remote_env_failures_total", "Remote environment calls that failed",
                       ["env", "reason"])


class RemoteFailure(Exception):
    """A remote call that gave no usable answer; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class RemoteEnvironment:
    def __init__(self, name: str, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, retries: int = RETRIES,
                 backoff_s: float = BACKOFF_S, breaker_failures: int = BREAKER_FAILURES,
                 breaker_open_s: float = BREAKER_OPEN_S, tracer: trace.Tracer | None = None,
                 security: SecurityConfig | None = None, wait_for_ready: bool = False) -> None:
        """`security`: the run's own, only for a server of the run (the reward model), never a third party's.
        `wait_for_ready`: a call waits (within its deadline) for a server that is not up yet, as the run's reward-model
        server is while it loads its model, instead of failing at once."""
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        self.wait_for_ready = wait_for_ready
        self._channel = channel(address, CHANNEL_OPTIONS, security=security)
        self._stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._tracer = tracer or trace.get_tracer("flywheel.environment")
        self._failures = 0
        self._open_until = 0.0

    @property
    def circuit_open(self) -> bool:
        return time.monotonic() < self._open_until

    async def check_reachable(self, timeout_s: float = 5.0) -> None:
        """Returns once connected; InvalidArgument on a refused connection or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        state = self._channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            left = deadline - time.monotonic()
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE or left <= 0:
                await self.close()
                why = "connection failed" if left > 0 else f"no connection within {timeout_s:g} s"
                raise InvalidArgument(f"environment {self.name!r}: {self.address} is unreachable ({why})")
            try:
                await asyncio.wait_for(self._channel.wait_for_state_change(state), left)
            except asyncio.TimeoutError:
                pass
            state = self._channel.get_state()

    async def step(self, request: environment_pb2.StepRequest, budget_s: float | None = None) -> list[StepResult]:
        """Results aligned with request.episodes; Unavailable when the remote gave no usable answer for them all."""
        n = len(request.episodes)
        with self._tracer.start_as_current_span("environment.remote_step", attributes={
                "env": self.name, "address": self.address, "episodes": n}) as span:
            try:
                response = await self._call("Step", request, budget_s)
                if len(response.results) != n:
                    raise RemoteFailure("bad_response", f"returned {len(response.results)} results for {n} episodes")
                results = [_decode(r) for r in response.results]
                if None in results:
                    raise RemoteFailure("bad_response", f"{results.count(None)} of {n} results had a non-finite "
                                                        f"reward")
            except RemoteFailure as err:
                raise self._fail(span, err) from None
            except Exception as err:  # on purpose: whatever the remote did, the caller is told UNAVAILABLE
                raise self._fail(span, RemoteFailure("error", f"{type(err).__name__}: {err}")) from None
            self._failures = 0
            return results

    async def prompts(self, request: environment_pb2.PromptsRequest) -> environment_pb2.PromptsResponse:
        """The remote's generated prompts. InvalidArgument when it has none to give, Unavailable when it fails."""
        try:
            response = await self._call("Prompts", request, None)
        except RemoteFailure as err:
            if err.__cause__ is not None and err.__cause__.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise InvalidArgument(f"remote environment {self.name!r} generates no prompts") from None
            self._note_failure(err)
            raise Unavailable(f"remote environment {self.name!r} at {self.address}: {err}") from None
        self._failures = 0
        return response

    async def _call(self, rpc: str, request, budget_s: float | None):
        """One rpc with per-attempt deadlines, retries and back-off inside `budget_s`; raises RemoteFailure."""
        if self.circuit_open:
            raise RemoteFailure("circuit_open", f"{self._failures} failed calls in a row; retrying in "
                                                f"{self._open_until - time.monotonic():.1f} s")
        deadline = time.monotonic() + (budget_s - MARGIN_S if budget_s is not None else math.inf)
        for attempt in range(self.retries + 1):
            timeout = min(self.timeout_s, deadline - time.monotonic())
            if timeout <= 0:
                raise RemoteFailure("deadline", "caller's deadline reached before the remote answered")
            try:
                return await getattr(self._stub, rpc)(request, timeout=timeout, wait_for_ready=self.wait_for_ready)
            except grpc.aio.AioRpcError as err:
                pause = self.backoff_s * 2**attempt
                if (err.code() not in RETRYABLE or attempt == self.retries
                        or time.monotonic() + pause >= deadline):
                    raise RemoteFailure(_label(err.code()), f"{err.code().name}: {err.details()}") from err
                await asyncio.sleep(pause)

    def _note_failure(self, err: RemoteFailure) -> None:
        """Breaker bookkeeping: `breaker_failures` failed calls in a row open the circuit (a good answer
        resets the count). A call the open circuit refused counts for nothing, so it half-opens on time."""
        if err.reason == "circuit_open":
            return
        self._failures += 1
        if self._failures >= self.breaker_failures:
            self._open_until = time.monotonic() + self.breaker_open_s

    def _fail(self, span, err: RemoteFailure) -> Unavailable:
        """Count and record a failed Step; the error its caller gets."""
        self._note_failure(err)
        FAILED_CALLS.labels(self.name, err.reason).inc()
        if err.reason != "circuit_open":
            log.warning("remote environment %s at %s failed: %s", self.name, self.address, err)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(err)))
        span.add_event("remote_env.failed", {"reason": err.reason, "detail": str(err)})
        return Unavailable(f"remote environment {self.name!r} at {self.address}: {err}")

    async def close(self) -> None:
        await self._channel.close()


def _label(code: grpc.StatusCode) -> str:
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "deadline"}.get(
        code, "rpc_error")


def _decode(r: environment_pb2.EpisodeResult) -> StepResult | None:
    """The result, or None when it is garbage (a non-finite reward)."""
    if not all(math.isfinite(x) for x in (r.reward, *r.named_rewards.values())):
        return None
    return StepResult(observation=r.observation.content, messages=[message_to_dict(m) for m in r.observations] or None,
                      reward=r.reward, named_rewards=dict(r.named_rewards),
                      terminated=r.terminated, next_stop_strings=list(r.next_stop_strings) or None,
                      metadata=from_struct(r.metadata) if r.HasField("metadata") else None,
                      answer=r.answer or None, error=r.error)
