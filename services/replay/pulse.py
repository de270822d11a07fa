"""A count of events and a wait for the next one: how one task of the replay service wakes another.

Ingest fires one after each write that stored groups (a Sample that is not ready yet waits on it), and the
step-report subscriber fires one after each report it recorded (a Commit that trails its report waits on it).
"""

from __future__ import annotations

import asyncio
import contextlib


class Pulse:
    def __init__(self) -> None:
        self.count = 0
        self._event = asyncio.Event()

    def fire(self) -> None:
        self.count += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once `count` has moved past `seen` (read it before the check that may need a wait, so an event
        in between is not missed) or after `timeout` seconds."""
        event = self._event
        if self.count != seen:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
