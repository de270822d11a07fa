"""A validation the controller requested is not lost when the controller is killed before it finishes: the
request is in the run's NATS KV bucket, and the next controller runs it. The first controller here is a real
process (the ValidationLoop and StateStore of services/controller) SIGKILLed while its validation runs; the oracle
is the bucket itself, read with nats-py: `validated.<v>` put, no request left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

from services.common.bus import VALIDATED, Bus
from services.common.config import load_config
from services.controller.evaluation import ValidationLoop
from services.controller.state import VALIDATING, StateStore
from services.controller.tracking import Tracker

RUN = "validation-resume"

KILLED = textwrap.dedent("""
    import asyncio, sys
    from services.common.bus import Bus
    from services.common.config import load_config
    from services.controller.evaluation import ValidationLoop
    from services.controller.state import StateStore
    from services.controller.tracking import Tracker

    class Hangs:  # the validation is still running (rollout busy) when the controller is killed
        async def run(self):
            await asyncio.Event().wait()

    async def main():
        bus = await Bus.connect(sys.argv[1], sys.argv[2], name="controller")
        state = await StateStore.open(bus.js, sys.argv[2])
        cfg = load_config(None, [f"run.run_dir={sys.argv[3]}"])
        loop = ValidationLoop(cfg, Hangs(), Tracker(cfg), state)
        await loop.request(4)
        print("requested", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


class Scores:
    """Rollout's answer to the next controller's validation."""

    async def run(self):
        return {"validation/accuracy": 0.5, "validation/policy_version": 6.0}, []


def test_a_validation_requested_before_the_controller_was_killed_runs_when_it_starts_again(tmp_path, nats_server):
    killed = subprocess.Popen([sys.executable, "-c", KILLED, nats_server.url, RUN, str(tmp_path / "first")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert killed.stdout.readline().strip() == "requested"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)

    async def next_controller():
        bus = await Bus.connect(nats_server.url, RUN, name="controller")
        try:
            state = await StateStore.open(bus.js, RUN)
            assert await state.kv.keys() == [f"{VALIDATING}4"]  # what the killed one left, as NATS holds it
            cfg = load_config(None, [f"run.run_dir={tmp_path / 'second'}"])
            loop = ValidationLoop(cfg, Scores(), Tracker(cfg), state)
            await loop.resume()
            await loop.drain()
            return await state.kv.keys(), (await state.kv.get(f"{VALIDATED}4")).value
        finally:
            await bus.close()

    keys, metrics = asyncio.run(next_controller())
    assert keys == [f"{VALIDATED}4"]  # validated, and no request left
    assert json.loads(metrics) == {"validation/accuracy": 0.5, "validation/policy_version": 6.0}
