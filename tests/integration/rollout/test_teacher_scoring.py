"""Distillation's data path over real processes: a rollout worker (tiny HF engine, environment service on
loopback) publishes each group only once `flywheel serve teacher` (a real child process) has scored it, and a
teacher killed -9 while a group waits is restarted and scores that group then.

Oracles from outside the code under test: the groups are read back from the NATS JetStream trajectory stream
itself, and each completion's top-k is recomputed by an unbatched forward of the same teacher weights and a
per-position loop over its full logits."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc
import pytest
import torch
from environment_service import serve_environment

from services.common.bus import Bus
from services.common.config import load_config, write_resolved
from services.common.infra import child_env, free_port
from services.common.pb.flywheel.v1 import rollout_pb2, rollout_pb2_grpc, types_pb2
from services.common.server import channel
from services.environment.base import make_environment
from services.rollout.engines.hf import HFEngine
from services.rollout.main import RolloutWorker
from services.rollout.teacher import load_teacher
from services.rollout.teacher_client import RECONNECT, RETRIES

K = 4
G = 2


def slow_topk(model, prompt: list[int], completion: list[int], k: int) -> tuple[list[float], list[int]]:
    """Flattened [n, k]: at position len(prompt) + t - 1 (the one that predicts token t), the k largest logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    values, ids = [], []
    for t in range(len(completion)):
        row = logits[len(prompt) + t - 1].tolist()
        order = sorted(range(len(row)), key=lambda v: -row[v])[:k]
        values += [row[v] for v in order]
        ids += order
    return values, ids


def assert_scored_by(model, traj: types_pb2.TrajectoryGroup) -> None:
    assert len(traj.completions) == G
    for c in traj.completions:
        assert len(c.token_ids) > 0 and c.teacher.k == K
        values, ids = slow_topk(model, list(traj.prompt_token_ids), list(c.token_ids), K)
        assert list(c.teacher.token_ids) == ids
        torch.testing.assert_close(torch.tensor(list(c.teacher.logits)), torch.tensor(values), rtol=0, atol=1e-4)


@pytest.fixture
def setup(tmp_path, nats_server):
    cfg = load_config(None, [
        f"addresses.nats_url={nats_server.url}", f"addresses.teacher=127.0.0.1:{free_port()}",
        "++distillation={}", "teacher.model_name=tiny", f"distillation.topk_logits_k={K}",
        "teacher.tiny={hidden_size: 96, num_hidden_layers: 3}",
        "teacher.timeout_s=5", f"distillation.num_generations_per_prompt={G}", "policy.generation.max_new_tokens=5",
        "rollout.max_groups_in_flight=1"])
    path = write_resolved(cfg, tmp_path)
    procs: list[subprocess.Popen] = []

    def start_teacher() -> subprocess.Popen:
        log = (tmp_path / f"teacher-{len(procs)}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "teacher", "--config", str(path)],
                                      stdout=log, stderr=subprocess.STDOUT, env=child_env()))
        return procs[-1]

    yield cfg, start_teacher
    for proc in procs:
        proc.kill()
        proc.wait(10)


def prompt_group(i: int) -> types_pb2.PromptGroup:
    row = make_environment("toy_copy").prompts(1, seed=0, offset=i)[0]
    return types_pb2.PromptGroup(group_id=f"g{i}", prompt_id=f"p{i}", env_name="toy_copy", num_generations=G,
                                 max_turns=1, messages=[types_pb2.ChatMessage(**m) for m in row["messages"]])


async def wait_serving(address: str) -> None:
    async with channel(address, RECONNECT) as ch:  # the teacher loads its model before it opens its port
        await rollout_pb2_grpc.TeacherServiceStub(ch).Score(rollout_pb2.ScoreRequest(
            prompt_token_ids=[5], completions=[rollout_pb2.TokenIds(ids=[6])]), timeout=60, wait_for_ready=True)


async def test_a_group_is_published_only_with_its_teachers_scores_and_waits_out_a_teacher_killed_9(setup):
    cfg, start_teacher = setup
    teacher = start_teacher()
    env_server, env_port = await serve_environment()
    cfg.addresses.environment = f"127.0.0.1:{env_port}"
    engine = HFEngine(cfg, "w")
    engine.version = 0  # the trainer's initial weights, as if synced
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
    worker = RolloutWorker(cfg, engine, bus, "w")
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    s = bus.subjects
    trajectories = await bus.js.pull_subscribe(s.trajectories, durable="test", stream=s.stream("traj"))

    async def next_group(timeout: float) -> types_pb2.TrajectoryGroup:
        [msg] = await trajectories.fetch(1, timeout=timeout)
        await msg.ack()
        return types_pb2.TrajectoryGroup.FromString(msg.data)

    try:
        await wait_serving(cfg.addresses.teacher)
        await bus.publish(s.work, prompt_group(0))
        first = await next_group(30)

        teacher.send_signal(signal.SIGKILL)
        teacher.wait(10)
        retries = RETRIES._value.get()
        await bus.publish(s.work, prompt_group(1))
        for _ in range(300):  # until the group, generated, has asked the dead teacher
            if RETRIES._value.get() > retries:
                break
            await asyncio.sleep(0.1)
        assert RETRIES._value.get() > retries
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):  # and it is not on the stream unscored
            await next_group(1)
        start_teacher()
        second = await next_group(60)
    finally:
        stop.set()
        await running
        await worker.teacher.close()
        await bus.close()
        await env_server.stop(0)

    model = load_teacher(cfg)  # the same weights, loaded apart from the server
    assert (first.group_id, second.group_id) == ("g0", "g1")
    assert_scored_by(model, first)
    assert_scored_by(model, second)


async def test_the_teacher_server_refuses_a_request_it_cannot_score_and_names_the_field(setup):
    cfg, start_teacher = setup
    start_teacher()
    await wait_serving(cfg.addresses.teacher)
    async with channel(cfg.addresses.teacher) as ch:
        stub = rollout_pb2_grpc.TeacherServiceStub(ch)
        for request, message in [
            (rollout_pb2.ScoreRequest(prompt_token_ids=[5]), "completions must not be empty"),
            (rollout_pb2.ScoreRequest(prompt_token_ids=[5], completions=[rollout_pb2.TokenIds(ids=[10**6])]),
             "completions[0]: token id 1000000 is outside the teacher's vocabulary"),
            (rollout_pb2.ScoreRequest(prompt_token_ids=[5] * cfg.policy.max_total_sequence_length,
                                      completions=[rollout_pb2.TokenIds(ids=[6])]),
             "(policy.max_total_sequence_length)"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Score(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
        reply = await stub.Score(rollout_pb2.ScoreRequest(prompt_token_ids=[5, 7], completions=[
            rollout_pb2.TokenIds(ids=[6, 8, 9]), rollout_pb2.TokenIds(ids=[])]), timeout=30)  # still serving
    assert [(t.k, len(t.logits), len(t.token_ids)) for t in reply.teacher] == [(K, 3 * K, 3 * K), (K, 0, 0)]
