"""Rollout's side of distillation: each finished group gets its teacher scores before it is published.

    EpisodeRunner ──TrajectoryGroup──▶ TeacherClient.score ──Score──▶ teacher replica (least busy)
                                            │ fills Completion.teacher
                                            ▼
                                      NATS trajectory stream

The worker calls `score` after the group has left the engine (its generation slot is free again), so the
engine generates the next groups while this group waits for the teacher. No group is published without its
scores: a call that fails for a reason a restart or another replica may cure (the teacher is down, loading,
restarting, late: server.RETRIED) is retried on the least busy replica after a back-off that doubles up to
MAX_BACKOFF_S, for as long as it takes; the group's work item is kept alive meanwhile (main.py _keep_alive), and
a worker stopping hands it back. A refusal (INVALID_ARGUMENT: the group does not fit the teacher) is raised: the
worker's failure path hands the group back and poisons it at rollout.max_group_failures.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Histogram

from services.common.config import SecurityConfig
from services.common.logs import RateLimitedLog
from services.common.pb.flywheel.v1 import rollout_pb2, rollout_pb2_grpc, types_pb2
from services.common.server import RETRIED, RPC_ERRORS, channel

log = logging.getLogger("flywheel.rollout.teacher")
_warn = RateLimitedLog(log)
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
SCORE_SECONDS = Histogram("flywheel_rollout_teacher_seconds", "Time a group waited for its teacher scores, retries "
                          "included", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
RECONNECT = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
             ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)))
"""gRPC's own reconnect back-off (1 s growing to 120 s by default) would leave a restarted teacher unused for up
to two minutes after a long outage: a channel reconnects within MAX_BACKOFF_S of the teacher coming back."""
RETRIES = Counter("flywheel_rollout_teacher_retries_total", "Score calls retried (teacher down, late or restarting)")


@dataclass(kw_only=True, slots=True)
class Replica:
    address: str
    stub: rollout_pb2_grpc.TeacherServiceStub
    in_flight: int = 0
    failing: bool = False
    """Its last call failed: the others are tried first until one of its calls succeeds."""


class TeacherClient:
    def __init__(self, addresses: list[str], security: SecurityConfig, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.channels = [channel(a, RECONNECT, security=security) for a in addresses]
        self.replicas = [Replica(address=a, stub=rollout_pb2_grpc.TeacherServiceStub(ch))
                         for a, ch in zip(addresses, self.channels, strict=True)]
        self.turn = 0

    def pick(self) -> Replica:
        """A replica that answered last time before one that failed, then the fewest calls in flight, ties taken
        in turn."""
        n = len(self.replicas)
        self.turn += 1
        order = sorted(range(n), key=lambda i: (self.replicas[i].failing, self.replicas[i].in_flight,
                                                (i - self.turn) % n))
        return self.replicas[order[0]]

    async def score(self, traj: types_pb2.TrajectoryGroup) -> None:
        """Fill every completion's `teacher`; returns only once it has."""
        request = rollout_pb2.ScoreRequest(prompt_token_ids=traj.prompt_token_ids, completions=[
            rollout_pb2.TokenIds(ids=c.token_ids) for c in traj.completions])
        with SCORE_SECONDS.time():
            reply = await self._call(request)
        check_reply(reply, traj)
        for completion, teacher in zip(traj.completions, reply.teacher, strict=True):
            completion.teacher.CopyFrom(teacher)

    async def _call(self, request: rollout_pb2.ScoreRequest) -> rollout_pb2.ScoreResponse:
        backoff = FIRST_BACKOFF_S
        while True:
            replica = self.pick()
            replica.in_flight += 1
            try:
                reply = await replica.stub.Score(request, timeout=self.timeout_s)
                replica.failing = False
                return reply
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRIED:
                    raise
                replica.failing = True
                RETRIES.inc()
                RPC_ERRORS.labels("TeacherService.Score", err.code().name).inc()
                _warn.warning(replica.address, "teacher %s: %s %s; the group waits and is retried",
                              replica.address, err.code().name, err.details())
            finally:
                replica.in_flight -= 1
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


def check_reply(reply: rollout_pb2.ScoreResponse, traj: types_pb2.TrajectoryGroup) -> None:
    """A reply that does not match its group would train on garbage: refuse it loudly."""
    if len(reply.teacher) != len(traj.completions):
        raise ValueError(f"teacher answered {len(reply.teacher)} completions for {len(traj.completions)}")
    for i, (t, c) in enumerate(zip(reply.teacher, traj.completions, strict=True)):
        n = len(c.token_ids) * t.k
        if t.k <= 0 or len(t.logits) != n or len(t.token_ids) != n:
            raise ValueError(f"teacher answer {i}: k={t.k}, {len(t.logits)} logits and {len(t.token_ids)} ids for "
                             f"{len(c.token_ids)} tokens")
