"""A service's work starts with the start-up heap (imports, model, engine) frozen out of the cyclic GC, so a
full collection never walks it mid-step (services/common/server.py, freeze_startup_heap)."""

from __future__ import annotations

import gc

from services.common.infra import free_port
from services.common.server import run_service


async def test_a_service_runs_its_work_with_the_startup_heap_frozen():
    seen: list[int] = []

    async def main(stop) -> None:
        seen.append(gc.get_freeze_count())

    gc.unfreeze()
    try:
        await run_service("test", f"127.0.0.1:{free_port()}", lambda server: None, main)
    finally:
        gc.unfreeze()  # the test process goes on as before
    assert seen and seen[0] > 1000, seen
