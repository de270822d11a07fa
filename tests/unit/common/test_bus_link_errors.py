"""A lost NATS connection is a warning, not a traceback: nats-py reconnects by itself (the fuzzer's flood once made
a real nats-server close replay's connection as a slow consumer, and the reconnect's ConnectionResetError reached
the log with its traceback, which the suite reads as an exception that escaped). Real nats-server, SIGKILLed and
started again on its port; the bus must be connected again afterwards, and the log must hold the warning."""

from __future__ import annotations

import asyncio
import logging

from services.common.bus import Bus
from services.common.infra import start_nats


def test_a_killed_and_restarted_server_is_logged_as_a_warning_and_the_bus_reconnects(tmp_path, caplog):
    server = start_nats(tmp_path / "nats")

    async def run() -> bool:
        bus = await Bus.connect(server.url, "link")
        try:
            server.stop(kill=True)
            await asyncio.sleep(1.5)  # reconnect attempts against the closed port, each an error for error_cb
            restarted = start_nats(tmp_path / "nats", server.port)
            try:
                for _ in range(100):
                    if bus.nc.is_connected:
                        break
                    await asyncio.sleep(0.1)
                return bus.nc.is_connected
            finally:
                await bus.nc.close()
                restarted.stop()
        finally:
            server.stop()

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(run()), "the bus did not reconnect to the restarted server"
    link = [r for r in caplog.records if "nats connection" in r.getMessage()]
    assert link and all(r.levelno == logging.WARNING for r in link), caplog.text
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged:\n" + caplog.text
