"""Bus.publish against a real nats-server that stops answering for a while (SIGSTOP, as a server too loaded to
ack): a deduplicated publish is sent again and stored once, a plain one raises. The oracle is the stream's own
message count, as the server reports it.

Under two test workers and a load of 9, a JetStream ack took over its 5 s and the controller, whose lease
publishes carry the group id, exited on the timeout (tests/integration/security/test_fuzz.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import nats.errors
import pytest
from faults import stop

from services.common.bus import Bus
from services.common.pb.flywheel.v1 import types_pb2

ACK_TIMEOUT_S = 0.5
"""JetStream's ack deadline here, shortened from its 5 s so the test waits less; the retry logic is the same."""


async def _connect(nats_server) -> tuple[Bus, types_pb2.PromptGroup]:
    bus = await Bus.connect(nats_server.url, "pause")
    bus.js = bus.nc.jetstream(timeout=ACK_TIMEOUT_S)
    return bus, types_pb2.PromptGroup(group_id="g-1")


async def _stored_before_a_marker(bus: Bus) -> int:
    """How many messages the work stream stored before a marker published now: its sequence, less one. Every send
    made while the server was stopped is ahead of the marker on the connection, so none can be counted late (the
    stream's message count, read at once, can lag what the server has read)."""
    ack = await bus.nc.jetstream(timeout=10).publish(bus.subjects.work, b"marker")
    return ack.seq - 1


async def test_a_deduplicated_publish_whose_ack_times_out_is_sent_again_and_stored_once(nats_server):
    bus, group = await _connect(nats_server)
    stop(nats_server.proc.pid)
    try:
        publish = asyncio.create_task(bus.publish(bus.subjects.work, group, msg_id="g-1"))
        await asyncio.sleep(3 * ACK_TIMEOUT_S)  # the first sends time out unanswered; a later one is acked
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    await publish
    assert await _stored_before_a_marker(bus) == 1
    await bus.close()


async def test_a_publish_without_an_id_raises_its_timeout_rather_than_risk_a_copy(nats_server):
    bus, group = await _connect(nats_server)
    # The server is stopped, every thread of it, before the publish is sent and until it has raised, so no ack
    # can race its timer (a SIGSTOP alone let a thread of nats-server ack once, under two suites at once).
    stop(nats_server.proc.pid)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await bus.publish(bus.subjects.work, group)
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    # The one send is stored once the server runs again, and nothing sent it a second time.
    assert await _stored_before_a_marker(bus) == 1
    await bus.close()
