"""A durable consumer's messages that a killed process was handed and never acked come to its successor when it
binds, not after ack_wait: the controller's event consumers (Bus.consume) against a real nats-server, with a
predecessor SIGKILLed inside its handler. ack_wait is an hour in both, so only the hand-back can deliver the event
while the test waits; the oracle is JetStream's own stream and consumer state.
(Replay's trajectory consumer: tests/integration/replay/test_crash_recovery.py.)"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from services.common import bus as bus_module
from services.common.bus import Bus
from services.common.pb.flywheel.v1 import types_pb2

HOUR_S = 3600.0
PREDECESSOR = """
import asyncio, sys
from services.common import bus as bus_module
from services.common.bus import Bus

async def main():
    bus_module.EVENT_ACK_WAIT_S = 3600.0
    bus = await Bus.connect(sys.argv[1], "takeback", name="controller")

    async def handler(msg):
        print("handed", flush=True)
        await asyncio.sleep(3600)  # killed here, before the ack

    await bus.consume(bus.subjects.stale, "controller-stale", handler)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_an_event_a_killed_controller_did_not_ack_is_delivered_to_its_successor_at_once(nats_server,
                                                                                               monkeypatch):
    monkeypatch.setattr(bus_module, "EVENT_ACK_WAIT_S", HOUR_S)
    bus = await Bus.connect(nats_server.url, "takeback")
    stream = bus.subjects.stream("events")
    predecessor = subprocess.Popen([sys.executable, "-c", PREDECESSOR, nats_server.url], stdout=subprocess.PIPE,
                                   text=True)
    try:
        await bus.publish(bus.subjects.stale, types_pb2.StaleGroups(group_ids=["g-1"]))
        handed = await asyncio.to_thread(predecessor.stdout.readline)
    finally:
        predecessor.send_signal(signal.SIGKILL)
        predecessor.wait()
    held = await bus.js.consumer_info(stream, "controller-stale")
    assert handed == "handed\n" and held.num_ack_pending == 1  # the kill left the event handed and unacked

    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg) -> None:
        await got.put(list(types_pb2.StaleGroups.FromString(msg.data).group_ids))

    await bus.consume(bus.subjects.stale, "controller-stale", handler)
    try:
        assert await asyncio.wait_for(got.get(), 30) == ["g-1"]  # the timeout only guards against a hang
        await asyncio.sleep(0.2)  # the ack follows the handler
        info, state = await bus.js.consumer_info(stream, "controller-stale"), await bus.js.stream_info(stream)
    finally:
        await bus.close()
    assert (info.num_ack_pending, state.state.messages) == (0, 0)  # acked: the work-queue stream dropped it
