"""The controller's Registry against a real environment service: every bad spec is a clear typed error."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from environment_service import serve_environment

from services.common.bus import Bus
from services.common.config import FlywheelConfig
from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.common.pb.flywheel.v1 import controller_pb2, environment_pb2, types_pb2
from services.common.data import LoadedData, PromptSet
from services.controller.main import resubmit, submit_data
from services.controller.registry import Registry
from services.controller.state import StateStore
from services.environment.server import MAX_PROMPTS


@pytest.fixture
async def environment_service():
    """[server, port]; a test may replace the server (a restart)."""
    running = list(await serve_environment())
    yield running
    await running[0].stop(0)


@pytest.fixture
async def registry(environment_service):
    reg = Registry(FlywheelConfig.model_validate({"addresses": {"environment": f"127.0.0.1:{environment_service[1]}"},
                                                  "grpo": {"max_rollout_turns": 3},
                                                  "environments": [{"name": "toy", "kind": "toy_copy"}]}))
    yield reg
    await reg.close()


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


async def test_a_timeout_grpc_cannot_represent_is_invalid_argument(registry, faulty_remote):
    """Found by tests/integration/security/test_fuzz.py: gRPC fails a call with a deadline 1e10 s away at once.
    The controller refuses it as longer than rollout's Step deadline; the environment service, which other
    clients may call, refuses it itself."""
    with pytest.raises(InvalidArgument, match=r"slow: timeout_seconds 1e\+10 must be below rollout.step_timeout_s"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="slow", address=faulty_remote.address,
                                                             rows=rows(1), timeout_seconds=1e10))
    for timeout in (1e10, float("inf")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await registry.env.Register(environment_pb2.RegisterRequest(name="slow", address=faulty_remote.address,
                                                                        timeout_seconds=timeout))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_seconds must be in [0, 86400]" in refused.value.details()
    assert registry.all() == []


async def test_a_remote_deadline_that_rollouts_step_call_would_cut_is_refused(registry, faulty_remote):
    limit = registry.cfg.rollout.step_timeout_s
    with pytest.raises(InvalidArgument, match=rf"slow: timeout_seconds {limit:g} must be below "
                                              rf"rollout.step_timeout_s \({limit:g}\)"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="slow", address=faulty_remote.address,
                                                             rows=rows(1), timeout_seconds=limit))
    assert registry.all() == []


async def test_empty_dataset_is_invalid_argument_and_leaves_nothing_registered(registry, faulty_remote, tmp_path):
    with pytest.raises(InvalidArgument, match=r"'m' has an empty dataset: give rows or jsonl_path"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="m", kind="math", weight=1.0))
    with pytest.raises(InvalidArgument, match=r"'r' has an empty dataset"):
        await registry.submit(controller_pb2.EnvironmentSpec(name="r", address=faulty_remote.address, weight=1.0))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InvalidArgument, match=r"environment 'e': dataset: .*empty.jsonl: the dataset is empty"):
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


async def test_a_restarted_environment_service_gets_the_mix_registered_again(registry, environment_service,
                                                                              faulty_remote):
    """The environment service keeps registrations in memory; the controller notices and registers them again."""
    await registry.submit(controller_pb2.EnvironmentSpec(name="calc", address=faulty_remote.address, rows=rows(2)))
    await registry.submit(controller_pb2.EnvironmentSpec(name="toy", kind="toy_copy", weight=1.0))
    assert await registry.register_lost() == [], "nothing is lost while the service runs"

    server, port = environment_service
    await server.stop(0)
    environment_service[0], _ = await serve_environment(port)  # as empty as a new process would start
    assert sorted(await registry.register_lost()) == ["calc", "toy"]
    listed = await registry.env.List(environment_pb2.ListRequest(), timeout=5)
    assert dict(listed.registered) == {"calc": faulty_remote.address, "toy": "builtin:toy_copy"}
    assert await registry.register_lost() == []


async def test_registering_the_same_source_again_is_a_no_op(registry):
    request = environment_pb2.RegisterRequest(name="toy", kind="toy_copy")
    await registry.env.Register(request, timeout=5)
    await registry.env.Register(request, timeout=5)  # a restarted controller does this
    with pytest.raises(grpc.aio.AioRpcError, match="ALREADY_EXISTS"):
        await registry.env.Register(environment_pb2.RegisterRequest(name="toy", kind="math"), timeout=5)


async def test_a_restarted_controller_has_the_submitted_environments_in_its_mix_again(registry, nats_server):
    bus = await Bus.connect(nats_server.url, "resubmit")
    try:
        store = await StateStore.open(bus.js, "resubmit")
        await store.save_submitted(controller_pb2.EnvironmentSpec(name="late", kind="toy_copy", rows=rows(3), weight=2))
        await store.save_submitted(controller_pb2.EnvironmentSpec(name="gone", address="127.0.0.1:1", rows=rows(1)))
        await store.save_submitted(controller_pb2.EnvironmentSpec(name="removed", kind="toy_copy", rows=rows(1)))
        await store.forget_submitted("removed")

        await resubmit(registry, await StateStore.open(bus.js, "resubmit"))  # what a restarted controller reads
        assert [e.spec.name for e in registry.all()] == ["late"]
        assert registry.all()[0].num_prompts == 3 and registry.all()[0].proto.weight == 2
        assert [s.name for s in await store.load_submitted()] == ["late"], "the unreachable one is dropped"
    finally:
        await bus.close()


async def test_train_datasets_join_the_mix_weighted_by_their_size_as_nemo_rl_concatenates_them(registry):
    cfg = FlywheelConfig.model_validate({"environments": [{"name": "toy", "kind": "toy_copy"}],
                                         "grpo": {"num_prompts_per_step": 2}})
    sets = [PromptSet(env_name="toy_copy", rows=rows(30)), PromptSet(env_name="toy_copy", rows=rows(10))]
    data = LoadedData(train=sets, validation=[])
    await submit_data(cfg, registry, data)
    assert [(e.spec.name, e.spec.weight, e.num_prompts) for e in registry.all()] == [
        ("toy_copy-0", 30.0, 30), ("toy_copy-1", 10.0, 10)]


async def test_an_environment_generates_validation_prompts_apart_from_its_training_stream(registry):
    await registry.submit(controller_pb2.EnvironmentSpec(
        name="puzzle", kind="sliding_puzzle", weight=1.0, max_turns=5,
        sampling=types_pb2.SamplingParams(stop_strings=["</action>"])))
    held_out = await registry.generated("puzzle", 3, seed=7)
    assert [(p.env_name, p.max_turns, list(p.sampling.stop_strings)) for p in held_out] == [
        ("puzzle", 5, ["</action>"])] * 3
    assert all(p.metadata["game_state"]["board"] for p in held_out)
    assert held_out == await registry.generated("puzzle", 3, seed=7)  # the same seed, the same prompts
    training = [await registry.entries["puzzle"].cursor.next() for _ in range(3)]  # the run's seed, 0
    assert [p.messages for p in held_out] != [row.messages for _, row in training]


async def test_many_validation_prompts_come_in_pieces_the_same_as_in_one_call(registry):
    await registry.submit(controller_pb2.EnvironmentSpec(name="puzzle", kind="sliding_puzzle", weight=1.0))
    pieces = await registry.generated("puzzle", MAX_PROMPTS + 1, seed=7)  # more than one call may ask for
    whole = [r for count, offset in ((MAX_PROMPTS, 0), (1, MAX_PROMPTS)) for r in (await registry.env.Prompts(
        environment_pb2.PromptsRequest(env_name="puzzle", count=count, seed=7, offset=offset))).rows]
    assert [(p.messages, p.metadata) for p in pieces] == [(r.messages, r.metadata) for r in whole]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # one call's limit: bounded work per request
        await registry.env.Prompts(environment_pb2.PromptsRequest(env_name="puzzle", count=MAX_PROMPTS + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"1..{MAX_PROMPTS}" in err.value.details()
