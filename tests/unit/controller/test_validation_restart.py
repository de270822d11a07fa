"""A validation cut short by a controller restart is run again by its successor (real NATS, real gRPC).

The trainer's step reports that request validations are not sent again, so the request itself is kept in the
run's state bucket until the validation is done. The oracle is what the trainer reads: `validated.<v>` in the
bucket (read_validated). The rollout service here is a gRPC server that answers Generate with one fixed
completion and can be held mid-call; the controller side (ValidationLoop, StateStore) is the real one.
"""

import asyncio

import grpc

from services.common.bus import Bus, read_validated
from services.common.config import load_config
from services.common.pb.flywheel.v1 import rollout_pb2, rollout_pb2_grpc, types_pb2
from services.controller.evaluation import ValidationLoop, Validator
from services.controller.state import StateStore
from services.controller.tracking import Tracker


class HeldRollout(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        self.called.set()
        await self.release.wait()
        return rollout_pb2.GenerateResponse(completions=[types_pb2.Completion(
            reward=1.0, text="4", generated_mask=[True], version_start=3) for _ in range(request.n)])


async def _loop(cfg, state: StateStore, address: str) -> ValidationLoop:
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.aio.insecure_channel(address))
    prompt = types_pb2.PromptGroup(messages=[types_pb2.ChatMessage(role="user", content="2+2?")])
    return ValidationLoop(cfg, Validator([prompt], stub, n=1), Tracker(cfg), state)


def _run(tmp_path, nats_url: str):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "run.name=val"])

    async def go():
        rollout = HeldRollout()
        server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(rollout, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        bus = await Bus.connect(nats_url, "val")
        first = await _loop(cfg, await StateStore.open(bus.js, "val"), address)
        first.request(3)
        await rollout.called.wait()  # validating version 3 when the controller dies
        for task in list(first._tasks):
            task.cancel()
        await bus.close()
        rollout.release.set()
        bus = await Bus.connect(nats_url, "val")
        state = await StateStore.open(bus.js, "val")
        second = await _loop(cfg, state, address)
        await second.resume()
        await second.drain()
        validated = await read_validated(bus.js, state.kv)
        requested = await state.load_requested()
        await bus.close()
        await server.stop(0)
        return validated, requested

    return asyncio.run(go())


def test_a_validation_cut_short_by_a_restart_is_run_again_and_reaches_the_trainer(tmp_path, nats_server):
    validated, requested = _run(tmp_path, nats_server.url)
    assert list(validated) == [3] and requested == []
    assert validated[3]["validation/accuracy"] == 1.0
    assert (tmp_path / "validation.jsonl").read_text().count('"version": 3') == 1
