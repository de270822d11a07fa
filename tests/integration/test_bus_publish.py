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

from services.common.bus import Bus
from services.common.pb.flywheel.v1 import types_pb2

ACK_TIMEOUT_S = 0.5
"""JetStream's ack deadline here, shortened from its 5 s so the test waits less; the retry logic is the same."""


async def _paused_publish(nats_server, msg_id: str | None) -> Bus:
    """Publish one lease while the server is stopped for three ack deadlines, then resumed; the Bus."""
    bus = await Bus.connect(nats_server.url, "pause")
    bus.js = bus.nc.jetstream(timeout=ACK_TIMEOUT_S)
    group = types_pb2.PromptGroup(group_id="g-1")
    os.kill(nats_server.proc.pid, signal.SIGSTOP)
    try:
        publish = asyncio.create_task(bus.publish(bus.subjects.work, group, msg_id=msg_id))
        await asyncio.sleep(3 * ACK_TIMEOUT_S)
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    await publish
    return bus


async def test_a_deduplicated_publish_whose_ack_times_out_is_sent_again_and_stored_once(nats_server):
    bus = await _paused_publish(nats_server, msg_id="g-1")
    info = await bus.js.stream_info(bus.subjects.stream("work"))
    assert info.state.messages == 1
    await bus.close()


async def test_a_publish_without_an_id_raises_its_timeout_rather_than_risk_a_copy(nats_server):
    with pytest.raises(nats.errors.TimeoutError):
        await _paused_publish(nats_server, msg_id=None)
