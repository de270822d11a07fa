"""Blocking calls off the event loop: SerialThread runs them in order on one thread, and hands back errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.common.server import SerialThread, in_daemon_thread


async def test_serial_thread_runs_calls_one_at_a_time_in_order_on_one_thread():
    thread = SerialThread("test")
    ran: list[tuple[int, str]] = []
    running = 0

    def work(i: int) -> int:
        nonlocal running
        running += 1
        assert running == 1, "two calls ran at once"
        time.sleep(0.002)
        ran.append((i, threading.current_thread().name))
        running -= 1
        return i * i

    results = await asyncio.gather(*(thread.call(work, i) for i in range(6)))
    thread.close()
    assert results == [i * i for i in range(6)]
    assert ran == [(i, "test") for i in range(6)]


async def test_serial_thread_hands_the_exception_to_its_caller_and_keeps_serving():
    thread = SerialThread("test")

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await thread.call(fail)
    assert await thread.call(lambda: 7) == 7
    thread.close()
    thread._thread.join(timeout=5)
    assert not thread._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        thread.call(lambda: 7)


async def test_in_daemon_thread_runs_each_call_on_a_new_daemon_thread():
    names = await asyncio.gather(*(in_daemon_thread(lambda: (threading.current_thread().name,
                                                             threading.current_thread().daemon)) for _ in range(3)))
    assert len({name for name, _ in names}) == 3 and all(daemon for _, daemon in names)
