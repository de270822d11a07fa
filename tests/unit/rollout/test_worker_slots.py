"""The rollout worker's back-pressure: max_groups_in_flight groups generate at once and as many more are scored
and published; a group's generation slot goes to the next group once the engine is done with it; the groups
pulled for slots that are free together come in one fetch. A fake work queue, engine runner and broker."""

from __future__ import annotations

import asyncio

from services.common.bus import Subjects
from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.main import RolloutWorker

N = 2  # rollout.max_groups_in_flight


class Msg:
    def __init__(self, i: int, log: list[str]) -> None:
        self.data = types_pb2.PromptGroup(group_id=f"g{i}", num_generations=1,
                                          messages=[types_pb2.ChatMessage(role="user", content="x")]).SerializeToString()
        self.headers = None
        self.id, self.log = f"g{i}", log

    async def ack(self) -> None:
        self.log.append(f"ack {self.id}")

    async def nak(self, delay: float | None = None) -> None:
        self.log.append(f"nak {self.id}")

    async def in_progress(self) -> None:
        pass


class Queue:
    """The work queue: fetch(n) returns what is there, up to n, or waits."""

    def __init__(self, msgs: list[Msg]) -> None:
        self.msgs, self.fetches = msgs, []

    async def fetch(self, n: int, timeout: float):
        if not self.msgs:
            await asyncio.sleep(timeout)
            raise TimeoutError
        self.fetches.append(n)
        taken, self.msgs = self.msgs[:n], self.msgs[n:]
        return taken


class Runner:
    """Generation ends when the test says so; then the runner reports the group generated."""

    def __init__(self) -> None:
        self.generating: dict[str, asyncio.Event] = {}
        self.waiting_to_finish: set[str] = set()

    async def run(self, group, worker_id, generated):
        self.generating[group.group_id] = done = asyncio.Event()
        await done.wait()
        del self.generating[group.group_id]
        self.waiting_to_finish.add(group.group_id)
        await generated()
        self.waiting_to_finish.discard(group.group_id)
        return types_pb2.TrajectoryGroup(group_id=group.group_id)


class Bus:
    def __init__(self, queue: Queue) -> None:
        self.subjects, self.queue = Subjects("slots"), queue
        self.js = self
        self.open = asyncio.Event()  # publishes wait for it: the broker is slow
        self.publishing: set[str] = set()

    async def pull_subscribe(self, *args, **kwargs) -> Queue:
        return self.queue

    async def publish(self, subject, traj, msg_id=None) -> None:
        self.publishing.add(msg_id)
        await self.open.wait()
        self.publishing.discard(msg_id)


class Engine:
    version = 0
    tokenizer = None


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_generating_and_finishing_slots_bound_the_groups_held():
    log: list[str] = []
    queue = Queue([Msg(i, log) for i in range(6)])
    bus = Bus(queue)
    cfg = load_config(None, [f"rollout.max_groups_in_flight={N}", "grpo.num_generations_per_prompt=1"])
    worker = RolloutWorker(cfg, Engine(), bus, "w")
    worker.runner = runner = Runner()
    stop = asyncio.Event()
    work = asyncio.create_task(worker._work(stop))
    await settle()
    assert queue.fetches == [N] and sorted(runner.generating) == ["g0", "g1"]  # both free slots, one fetch

    for done in list(runner.generating.values()):  # generated; the broker holds their publishes
        done.set()
    await settle()
    assert bus.publishing == {"g0", "g1"}
    assert queue.fetches == [N, N] and sorted(runner.generating) == ["g2", "g3"]  # the engine goes on

    for done in list(runner.generating.values()):  # generated too, but every finishing slot is taken
        done.set()
    await settle()
    assert runner.waiting_to_finish == {"g2", "g3"} and queue.fetches == [N, N]  # so no pull: 2N held at most
    assert worker.in_flight == 2 * N

    bus.open.set()  # the broker stores them: the finishing slots pass on, then the generation slots
    await settle()
    assert queue.fetches == [N, N, N] and sorted(runner.generating) == ["g4", "g5"]
    for done in list(runner.generating.values()):
        done.set()
    await settle()
    assert sorted(log) == [f"ack g{i}" for i in range(6)] and worker.in_flight == 0
    stop.set()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
