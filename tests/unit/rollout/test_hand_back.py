"""What the rollout worker does with a group whose environment could not score it: UNAVAILABLE (the service or a
remote environment is down) hands it back after a delay that grows with its deliveries; NOT_FOUND (its environment
left the mix) announces it stale for the controller to replace, and drops it. A fake work item, runner and broker."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from services.common.bus import Subjects
from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.agent_groups import AgentFailed
from services.rollout.main import MAX_HAND_BACK_S, RolloutWorker, Slot, Slots, hand_back_delay


class Msg:
    def __init__(self, deliveries: int) -> None:
        group = types_pb2.PromptGroup(group_id="g", env_name="remote", num_generations=1,
                                      messages=[types_pb2.ChatMessage(role="user", content="x")])
        self.data = group.SerializeToString()
        self.headers = None
        self.metadata = SimpleNamespace(num_delivered=deliveries)
        self.outcome: tuple | None = None

    async def ack(self) -> None:
        self.outcome = ("ack",)

    async def nak(self, delay: float | None = None) -> None:
        self.outcome = ("nak", delay)

    async def term(self) -> None:
        self.outcome = ("term",)

    async def in_progress(self) -> None:
        pass


class Failing:
    """A runner whose environment Step failed with `code`."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def run(self, group, worker_id, generated):
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="remote down")


class Bus:
    def __init__(self) -> None:
        self.subjects = Subjects("hand-back")
        self.published: list[tuple[str, bytes, str]] = []

    async def publish(self, subject, message, msg_id=None) -> None:
        self.published.append((subject, message.SerializeToString(), msg_id))


class Engine:
    version = 0
    tokenizer = None


async def handle(code: grpc.StatusCode, deliveries: int) -> tuple[Msg, Bus]:
    bus = Bus()
    worker = RolloutWorker(load_config(None, []), Engine(), bus, "w")
    worker.runner = Failing(code)
    msg = Msg(deliveries)
    await worker._handle(msg, Slot(Slots(1)))
    return msg, bus


@pytest.mark.parametrize("deliveries, delay", [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, MAX_HAND_BACK_S),
                                               (40, MAX_HAND_BACK_S)])
async def test_an_unavailable_environment_hands_the_group_back_later_each_time(deliveries, delay):
    msg, bus = await handle(grpc.StatusCode.UNAVAILABLE, deliveries)
    assert msg.outcome == ("nak", delay) and bus.published == []
    assert hand_back_delay(deliveries) == delay


async def test_a_group_whose_environment_is_gone_is_announced_stale_and_dropped():
    msg, bus = await handle(grpc.StatusCode.NOT_FOUND, 1)
    assert msg.outcome == ("term",)
    [(subject, data, msg_id)] = bus.published
    assert subject == bus.subjects.stale and msg_id == "gone:g"
    assert list(types_pb2.StaleGroups.FromString(data).group_ids) == ["g"]


class FailingAgents:
    """An agent environment whose episode failed (the agent crashed)."""

    async def is_agent(self, env_name):
        return True

    async def run(self, group, endpoint, version, worker_id):
        raise AgentFailed("crash", "exit status 3")


async def test_a_group_whose_agent_failed_is_handed_back_then_poisoned_at_the_bound():
    cfg = load_config(None, [])
    bound = cfg.rollout.max_group_failures
    for deliveries, outcome in ((1, ("nak", 1.0)), (bound, ("term",))):
        bus = Bus()
        worker = RolloutWorker(cfg, Engine(), bus, "w")
        worker.agents, worker.endpoint = FailingAgents(), object()
        msg = Msg(deliveries)
        await worker._handle(msg, Slot(Slots(1)))
        assert msg.outcome == outcome
        assert [s for s, _, _ in bus.published] == ([] if deliveries == 1 else [bus.subjects.poisoned])
