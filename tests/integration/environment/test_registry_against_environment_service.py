"""The controller's Registry against a real environment service: every bad spec is a clear typed error."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.common.config import FlywheelConfig
from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.common.pb.flywheel.v1 import controller_pb2, environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import ErrorInterceptor
from services.controller.registry import Registry
from services.environment.server import EnvironmentServicer


@pytest.fixture
async def registry():
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reg = Registry(FlywheelConfig.model_validate({"addresses": {"environment": f"127.0.0.1:{port}"},
                                                  "grpo": {"max_rollout_turns": 3}}))
    yield reg
    await reg.close()
    await server.stop(0)


def rows(n: int) -> list[types_pb2.DatasetRow]:
    return [types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content=f"copy {i}")]) for i in range(n)]


async def test_a_remote_with_inline_rows_joins_the_mix_without_keeping_the_rows(registry, faulty_remote):
    entry = await registry.submit(controller_pb2.EnvironmentSpec(name="calc", address=faulty_remote.address,
                                                                 rows=rows(4), weight=2.0, reward_scale=0.5))
    assert entry.num_prompts == 4 and len(entry.proto.rows) == 0
    assert entry.max_turns == 3, "max_turns 0 falls back to grpo.max_rollout_turns"
    assert entry.reward_scale == 0.5
    assert registry.choose(random.Random(0)) is entry
    assert (await entry.cursor.next())[1].messages[0].content == "copy 0"


async def test_a_builtin_that_generates_prompts_needs_no_dataset(registry):
    entry = await registry.submit(controller_pb2.EnvironmentSpec(name="toy", kind="toy_copy", weight=1.0))
    assert entry.num_prompts == 0 and (await entry.cursor.next())[1].messages


async def test_unknown_kind_names_the_builtin_kinds(registry):
    with pytest.raises(InvalidArgument, match=r"environment 'x': unknown environment kind 'chess'.*math"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="x", kind="chess", weight=1.0))
    assert registry.all() == []


async def test_duplicate_name_is_already_exists_with_the_way_out(registry):
    await registry.submit(controller_pb2.EnvironmentSpec(name="toy", kind="toy_copy", weight=1.0))
    with pytest.raises(AlreadyExists, match=r"'toy' is already in the mix; remove it first"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="toy", kind="toy_copy", weight=1.0))


async def test_concurrent_submits_of_one_name_admit_exactly_one(registry):
    spec = controller_pb2.EnvironmentSpec(name="twice", kind="toy_copy", weight=1.0)
    outcomes = await asyncio.gather(registry.submit(spec), registry.submit(spec), return_exceptions=True)
    assert sum(isinstance(o, AlreadyExists) for o in outcomes) == 1 and len(registry.all()) == 1


async def test_unreachable_address_is_invalid_argument(registry):
    with pytest.raises(InvalidArgument, match=r"127.0.0.1:1 is unreachable"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="gone", address="127.0.0.1:1", rows=rows(1)))


async def test_empty_dataset_is_invalid_argument_and_leaves_nothing_registered(registry, faulty_remote, tmp_path):
    with pytest.raises(InvalidArgument, match=r"'m' has an empty dataset: give rows or jsonl_path"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="m", kind="math", weight=1.0))
    with pytest.raises(InvalidArgument, match=r"'r' has an empty dataset"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="r", address=faulty_remote.address, weight=1.0))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InvalidArgument, match=r"environment 'e': dataset .*empty.jsonl' is empty"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="e", kind="math",
                                                             jsonl_path=str(tmp_path / "empty.jsonl")))
    listed = await registry.env.List(environment_pb2.ListRequest())
    assert not {"m", "r", "e"} & set(listed.registered)


async def test_remove_stops_choice_and_an_unknown_name_is_not_found(registry):
    await registry.submit(controller_pb2.EnvironmentSpec(name="a", kind="toy_copy", weight=1.0))
    await registry.submit(controller_pb2.EnvironmentSpec(name="b", kind="toy_copy", weight=1.0))
    await registry.remove("a")
    assert {registry.choose(random.Random(s)).spec.name for s in range(20)} == {"b"}
    with pytest.raises(NotFound, match=r"no environment named 'a' in the mix \(environments: b\)"):
        await registry.remove("a")
