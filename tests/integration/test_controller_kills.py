"""A controller SIGKILLed at each point of its lease/save sequence, restarted from its saved state against the same
JetStream, over seeded runs: the work stream ends up holding every prompt the run leases exactly once.

Each life of the controller is a forked process running the real Controller.run loop (lease window, state save,
the dynamic-sampling consumer) against a real nats-server; the test plays rollout (its weight loads open the
admission window) and replay (it announces one group of each step filtered, so refills are drawn outside the
window, as they are in a run). A life is armed to SIGKILL itself at one point: before or after the n-th publish of
a lease (a window's or an event's), before or after the n-th write of the run state (a unit's intent, or its
outcome), after the n-th write of the leases (the outcome's first half), before an event's ack. The next life starts from what the KV bucket holds. A last life runs to the end.

The oracle is JetStream's: the work stream's messages, read back one by one (their Nats-Msg-Id and the prompt each
carries), against a run of the same seed that nobody killed: the same prompts, each once, each step with its
groups. Nothing the controller reports about itself is used.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from types import SimpleNamespace

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError

from services.common import bus as bus_module
from services.common.bus import Bus
from services.common.config import load_config
from services.common.data import load_data
from services.common.infra import free_port
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2
from services.controller.datasets import EpochCursor
from services.controller.main import Controller
from services.controller.registry import Entry, Registry
from services.controller.state import StateStore

ROWS, PER_STEP, STEPS = 60, 2, 16
"""One epoch: 16 steps of 2 prompts, plus a refill for each step, draw 48 of its 60 rows."""
POINTS = [("publish", "before", "window"), ("publish", "after", "window"), ("save", "before", None),
          ("save", "after", None), ("save_leases", "after", None), ("publish", "after", "event"),
          ("ack", "before", None), ("publish", "before", "event")]
"""Where a life is killed: (operation, before/after it, whose lease: the window's or an event handler's)."""
SOURCE = contextvars.ContextVar("lease_source", default="window")


def _cfg(tmp_path, url: str, run: str):
    train = tmp_path / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps({"problem": f"p{i}", "expected_answer": str(i)}) + "\n" for i in range(ROWS)))
    return load_config(None, [
        "environments=[]", f"data.train.data_path={train}", f"grpo.num_prompts_per_step={PER_STEP}",
        "grpo.max_num_epochs=1", f"grpo.max_num_steps={STEPS}", "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.max_trajectory_age_steps=1", "grpo.dynamic_sampling_max_gen_batches=3",
        f"addresses.nats_url={url}", f"addresses.environment=127.0.0.1:{free_port()}", f"run.name={run}"])


def _arm(point: tuple[str, str, str | None], nth: int) -> None:
    """Makes this process SIGKILL itself at the nth time it reaches `point` (patched in the forked child only)."""
    op, phase, source = point
    seen = Counter()

    def at(name: str, when: str) -> None:
        if (name, when) == (op, phase) and source in (None, SOURCE.get()):
            seen[name] += 1
            if seen[name] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, attr: str, name: str, only=lambda *args: True):
        real = getattr(owner, attr)

        async def wrapped(*args, **kwargs):
            counts = only(*args)  # decided before the call: a save's "does it write" changes with it
            if counts:
                at(name, "before")
            out = await real(*args, **kwargs)
            if counts:
                at(name, "after")
            return out
        setattr(owner, attr, wrapped)

    wrap(Bus, "publish", "publish", only=lambda bus, subject, *a: subject == bus.subjects.work)
    wrap(StateStore, "save", "save", only=lambda store, state: state.encode() != store._last)  # writes only
    wrap(StateStore, "save_leases", "save_leases", only=lambda store, leased: set(leased) != store._stored)
    wrap(Msg, "ack", "ack")
    real_lease = Controller._lease

    async def lease(self, *args, **kwargs):
        token = SOURCE.set("event")  # an event's replacement (or its redo at restart), not a window's leases
        try:
            return await real_lease(self, *args, **kwargs)
        finally:
            SOURCE.reset(token)
    Controller._lease = lease


async def _controller(cfg, bus: Bus) -> Controller:
    rows = load_data(cfg).train[0].rows
    registry = Registry(cfg)  # entries set here: no environment service in this test
    registry.entries["math"] = Entry(proto=controller_pb2.EnvironmentSpec(name="math", kind="math", weight=1),
                                     cursor=EpochCursor(rows, prompts_per_step=PER_STEP, epochs=1, seed=cfg.run.seed,
                                                        shuffle=True), num_prompts=len(rows))
    controller = Controller(cfg, bus, registry, None, await StateStore.open(bus.js, cfg.run.name))
    await controller.resume()
    return controller


async def _announce_filtered(bus: Bus, controller: Controller) -> None:
    """What replay does with a group whose rewards are all equal: the first group of every leased step. The msg id
    makes a later life's announcement of the same step a duplicate JetStream drops."""
    for t in range(controller.next_target):
        gid = controller._group_id(f"step/{t}/0")
        await bus.js.publish(bus.subjects.filtered, types_pb2.StaleGroups(group_ids=[gid]).SerializeToString(),
                             headers={"Nats-Msg-Id": f"filtered/{t}"})


async def _settled(bus: Bus, controller: Controller) -> bool:
    """Every step leased, its announcement made (this tick) and handled."""
    if controller.next_target < STEPS:
        return False
    info = await bus.js.consumer_info(bus.subjects.stream("events"), "controller-filtered")
    return info.num_pending == 0 and info.num_ack_pending == 0


async def _life(cfg) -> None:
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
    controller = await _controller(cfg, bus)
    stop = asyncio.Event()

    async def rollout_and_replay():
        while True:
            controller.workers["rollout"] = (controller.next_target, time.monotonic())  # a weight load: k = 1 opens 2
            controller.wake.set()
            await _announce_filtered(bus, controller)
            if await _settled(bus, controller):
                break
            await asyncio.sleep(0.02)
        stop.set()

    other = asyncio.create_task(rollout_and_replay())
    await controller.run(stop)
    await other
    await bus.close()


def _child(cfg, point, nth) -> None:
    # An hour: an event a killed life did not ack comes to the next one only by its take-back (Bus.take_back); with
    # it removed, the last life waits and the test fails.
    bus_module.EVENT_ACK_WAIT_S = 3600.0
    if point is not None:
        _arm(point, nth)
    asyncio.run(_life(cfg))


def _run_life(cfg, point=None, nth=1) -> int:
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(cfg, point, nth))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:  # hung: SIGTERM, so its exit code is not taken for the point's SIGKILL
        proc.terminate()
        proc.join()
    return proc.exitcode


async def _work_stream(url: str, run: str) -> list[tuple[str, types_pb2.PromptGroup]]:
    """Every message the run's work stream holds (nobody consumed it): its Nats-Msg-Id and its group."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = bus_module.Subjects(run).stream("work")
    state = (await js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg(stream, seq)
        out.append((msg.headers["Nats-Msg-Id"], types_pb2.PromptGroup.FromString(msg.data)))
    await nc.close()
    assert len(out) == state.messages
    return out


def _check(held: list[tuple[str, types_pb2.PromptGroup]], reference: list[tuple[str, types_pb2.PromptGroup]]) -> None:
    prompts = [g.prompt_id for _, g in held]
    twice = [p for p, n in Counter(prompts).items() if n > 1]
    assert not twice, f"prompts leased twice: {twice}"
    lost = sorted({g.prompt_id for _, g in reference} - set(prompts))
    assert not lost, f"prompts of the run never leased: {lost}"
    assert len(held) == len(reference) == STEPS * (PER_STEP + 1)
    assert all(msg_id == g.group_id for msg_id, g in held)
    assert Counter(g.target_step for _, g in held) == {t: PER_STEP + 1 for t in range(STEPS)}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_controller_killed_at_each_point_of_its_lease_sequence_leases_each_prompt_once(tmp_path, nats_server, seed):
    rng = random.Random(seed)
    assert _run_life(_cfg(tmp_path, nats_server.url, f"ref{seed}")) == 0
    reference = asyncio.run(_work_stream(nats_server.url, f"ref{seed}"))
    cfg = _cfg(tmp_path, nats_server.url, f"killed{seed}")
    points = rng.sample(POINTS, len(POINTS))
    for point in points:
        nth = rng.randint(1, 3)
        assert _run_life(cfg, point, nth) == -signal.SIGKILL, f"never reached {point} #{nth}"
    assert _run_life(cfg) == 0, "the last life did not finish the run (its traceback is above)"
    _check(asyncio.run(_work_stream(nats_server.url, f"killed{seed}")), reference)


def _filtered(gid: str):
    """A filtered announcement as the consumer hands it to the handler."""
    return SimpleNamespace(data=types_pb2.StaleGroups(group_ids=[gid]).SerializeToString())


async def _lease_window_and_refill(controller: Controller, version: int) -> None:
    controller.workers["rollout"] = (version, time.monotonic())
    await controller._lease_window()
    await controller._on_filtered(_filtered(controller._group_id(f"step/{version}/0")))


def test_a_lease_unit_that_fails_half_done_stops_the_controller_and_its_successor_finishes_it(tmp_path, nats_server):
    """A refill whose publish fails for good (here the work stream is gone) has drawn its prompt and saved its
    intent. nats-py would only log the handler's error, and the controller would go on past that draw; it stops
    instead, and its successor redoes the refill: the run leases the same prompts as one where nothing failed."""
    async def reference():
        cfg = _cfg(tmp_path, nats_server.url, "unbroken")
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _lease_window_and_refill(controller, 0)
        await _lease_window_and_refill(controller, 2)
        await bus.close()
        return [g.prompt_id for _, g in await _work_stream(nats_server.url, cfg.run.name)]

    async def broken_then_restarted():
        cfg = _cfg(tmp_path, nats_server.url, "broken")
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        first = await _controller(cfg, bus)
        first.workers["rollout"] = (0, time.monotonic())
        await first._lease_window()
        before = [g.prompt_id for _, g in await _work_stream(nats_server.url, cfg.run.name)]
        await bus.js.delete_stream(bus.subjects.stream("work"))
        with pytest.raises(NoStreamResponseError):
            await first._on_filtered(_filtered(first._group_id("step/0/0")))
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.0, stop.set)  # how long it may go on, were it not to stop
        with pytest.raises(NoStreamResponseError):  # the same error, raised by the run loop
            await first.run(stop)
        await bus.close()
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)  # the work stream is back, empty
        second = await _controller(cfg, bus)  # redoes the refill
        await _lease_window_and_refill(second, 2)
        await bus.close()
        return before + [g.prompt_id for _, g in await _work_stream(nats_server.url, cfg.run.name)]

    expected = asyncio.run(reference())
    leased = asyncio.run(broken_then_restarted())
    assert len(expected) == 10 and Counter(leased) == Counter(expected)
