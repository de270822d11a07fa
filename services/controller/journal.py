"""Write-ahead leasing: a lease is saved before it is published, so no restart draws its prompt again.

    draw the groups (cursors advance) ──▶ put RunState{cursors, pending = the groups} ─┐  one KV put: the commit
                                                                                       ▼
    publish each group (Nats-Msg-Id = group id) ──▶ put lease.<id> records, RunState{pending = {}}
    controller start ──▶ publish the saved pending groups again ──▶ JetStream drops those it already holds

The RunState put is the only step that matters: once it is in the bucket, a successor starts past the
prompts it drew (their cursor offsets are in it) and holds the groups themselves (pending), so it
publishes them, whether or not the dead controller had; before it, the successor draws them again from
the same state. Publishing before saving, as this controller once did, was safe only while every draw
followed from the saved state alone: a refill or a replacement drawn from a cursor between a window's
publish and its save put that prompt into a later step too after a restart (a prompt trained twice).
A group published, then published again on restart, is dropped by the work stream's duplicate window
(bus.WORK_DEDUP_WINDOW_S); replay also stores a group id once while it holds it. Callers hold
Controller.leasing across draw, save and publish, so no save writes another lease's half-done state.
"""

from __future__ import annotations

import asyncio
import base64

from opentelemetry import trace

from services.common.bus import Bus
from services.common.pb.flywheel.v1 import types_pb2


def encode(groups: list[types_pb2.PromptGroup]) -> dict[str, str]:
    """Groups as RunState.pending holds them (JSON): group id -> the serialized PromptGroup."""
    return {g.group_id: base64.b64encode(g.SerializeToString()).decode() for g in groups}


def decode(pending: dict[str, str]) -> list[types_pb2.PromptGroup]:
    return [types_pb2.PromptGroup.FromString(base64.b64decode(v)) for v in pending.values()]


async def publish(bus: Bus, tracer: trace.Tracer, groups: list[types_pb2.PromptGroup]) -> None:
    """Publishes the groups at once, not one broker round trip after another (16 leases: 0.6 ms instead of
    2.1 on an idle machine): a rollout worker finds a step's groups in the queue together and its engine
    batches them. A failed publish raises; the controller then stops, and its successor publishes the
    saved pending groups again."""

    async def one(group: types_pb2.PromptGroup) -> None:
        with tracer.start_as_current_span("controller.lease", attributes={  # the group's trace starts here
                "flywheel.group_id": group.group_id, "flywheel.target_step": group.target_step,
                "flywheel.env": group.env_name}):
            await bus.publish(bus.subjects.work, group, msg_id=group.group_id)

    await asyncio.gather(*map(one, groups))


def locked(lock: asyncio.Lock, handler):
    """`handler` run under `lock`: an event's bookkeeping (a popped lease, a count) and the lease it makes
    are saved together, never split by another lease's save."""

    async def run(msg) -> None:
        async with lock:
            await handler(msg)

    return run
