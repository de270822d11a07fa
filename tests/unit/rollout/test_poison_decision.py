"""A group whose episode fails with an error no redelivery fixes is handed back until its
rollout.max_group_failures-th delivery, then poisoned: announced (PoisonedGroup), counted and dropped. Outages
are handed back for as long as they last, whatever the count. The decision is pure (failures.py); the worker's
part is checked with a fake work item and broker, the runner raising what a real chat template raises."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import jinja2
import nats.errors
import pytest
from prometheus_client import REGISTRY

from services.common.bus import Subjects
from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.failures import GONE, HAND_BACK, MAX_ERROR_CHARS, POISON, describe, fate
from services.rollout.main import RolloutWorker, Slot, Slots


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="it broke")


@pytest.mark.parametrize("deliveries, expected", [(1, HAND_BACK), (2, HAND_BACK), (3, POISON), (40, POISON)])
def test_an_error_no_redelivery_fixes_is_handed_back_until_the_bound(deliveries, expected):
    assert fate(ValueError("tokenizer.chat_template is not set"), deliveries, max_failures=3) == expected


@pytest.mark.parametrize("err", [rpc_error(grpc.StatusCode.UNAVAILABLE), rpc_error(grpc.StatusCode.CANCELLED),
                                 rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), nats.errors.TimeoutError()],
                         ids=["unavailable", "cancelled", "deadline", "nats"])
def test_an_outage_is_handed_back_however_often_it_was_delivered(err):
    assert fate(err, 1000, max_failures=3) == HAND_BACK


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_an_environment_that_broke_on_the_group_counts_toward_the_bound(code):
    assert fate(rpc_error(code), 2, max_failures=3) == HAND_BACK
    assert fate(rpc_error(code), 3, max_failures=3) == POISON


def test_a_refused_request_counts_and_a_gone_environment_is_gone():
    assert fate(rpc_error(grpc.StatusCode.INVALID_ARGUMENT), 3, max_failures=3) == POISON
    assert fate(rpc_error(grpc.StatusCode.NOT_FOUND), 1, max_failures=3) == GONE


def test_a_bound_of_one_poisons_on_the_first_failure():
    assert fate(KeyError("x"), 1, max_failures=1) == POISON


def test_the_error_is_described_on_one_short_line():
    assert describe(rpc_error(grpc.StatusCode.INVALID_ARGUMENT)) == "AioRpcError: INVALID_ARGUMENT it broke"
    long = describe(ValueError("line one\nline two " + "x" * 2000))
    assert long.startswith("ValueError: line one line two x") and "\n" not in long and len(long) == MAX_ERROR_CHARS


class Msg:
    def __init__(self, deliveries: int) -> None:
        self.data = types_pb2.PromptGroup(group_id="g1", prompt_id="data/e0/7", env_name="math", num_generations=1,
                                          messages=[types_pb2.ChatMessage(role="system", content="x")]
                                          ).SerializeToString()
        self.headers = None
        self.metadata = SimpleNamespace(num_delivered=deliveries)
        self.outcome: tuple | None = None

    async def nak(self, delay: float | None = None) -> None:
        self.outcome = ("nak", delay)

    async def term(self) -> None:
        self.outcome = ("term",)

    async def in_progress(self) -> None:
        pass


class Refusing:
    """A runner whose chat template refuses the conversation, as Gemma's does a system message."""

    async def run(self, group, worker_id, generated):
        raise jinja2.exceptions.TemplateError("System role not supported")


class Bus:
    def __init__(self) -> None:
        self.subjects = Subjects("poison")
        self.published: list[tuple[str, types_pb2.PoisonedGroup, str]] = []

    async def publish(self, subject, message, msg_id=None) -> None:
        self.published.append((subject, message, msg_id))


async def handle(deliveries: int) -> tuple[Msg, Bus]:
    bus = Bus()
    worker = RolloutWorker(load_config(None, ["rollout.max_group_failures=3"]),
                           SimpleNamespace(version=0, tokenizer=None), bus, "w")
    worker.runner = Refusing()
    msg = Msg(deliveries)
    await worker._handle(msg, Slot(Slots(1)))
    return msg, bus


def poisoned_total() -> float:
    return REGISTRY.get_sample_value("flywheel_rollout_poisoned_groups_total") or 0.0


async def test_the_worker_hands_the_group_back_before_the_bound():
    before = poisoned_total()
    msg, bus = await handle(2)
    assert msg.outcome == ("nak", 2.0) and bus.published == []
    assert poisoned_total() == before


async def test_the_worker_announces_counts_and_drops_the_group_at_the_bound():
    before = poisoned_total()
    msg, bus = await handle(3)
    assert msg.outcome == ("term",)
    [(subject, event, msg_id)] = bus.published
    assert subject == Subjects("poison").poisoned and msg_id == "poisoned:g1"
    assert (event.group_id, event.prompt_id, event.env_name, event.deliveries, event.worker_id) == (
        "g1", "data/e0/7", "math", 3, "w")
    assert event.error == "TemplateError: System role not supported"
    assert poisoned_total() == before + 1
