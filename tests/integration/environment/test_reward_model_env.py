"""The reward_model environment end to end over real processes: `flywheel serve environment` forwards the episodes
of kind reward_model to `flywheel serve reward_model` (the tiny random reward model), with the run's token."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from environment_service import serve_environment

from services.common.config import SecurityConfig, load_config, write_resolved
from services.common.infra import child_env, free_port
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import channel
from services.rollout.reward_model import RewardModel

TOKEN = "reward-model-test-token"
CHATS = [("1+1", "2"), ("copy abc", "abc abc abc"), ("say hi", "hello there")]


def _episode(prompt: str, response: str) -> environment_pb2.Episode:
    return environment_pb2.Episode(messages=[types_pb2.ChatMessage(role="user", content=prompt),
                                             types_pb2.ChatMessage(role="assistant", content=response)])


@pytest.fixture
def run(tmp_path):
    """(config, start(service)): the run's config, and a starter of its services as processes."""
    rows = tmp_path / "rows.jsonl"  # the kind generates no prompts; this test sends its own episodes
    rows.write_text('{"messages": [{"role": "user", "content": "copy 3"}]}\n')
    cfg = load_config(None, [f"addresses.environment=127.0.0.1:{free_port()}",
                             f"addresses.reward_model=127.0.0.1:{free_port()}", "env.reward_model.model_name=tiny",
                             "env.reward_model.precision=float32",
                             f"environments=[{{name: rm, kind: reward_model, dataset: {rows}}}]"])
    path = write_resolved(cfg, tmp_path)
    procs = []

    def start(service: str) -> None:
        log = (tmp_path / f"{service}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", service, "--config", str(path)],
                                      stdout=log, stderr=subprocess.STDOUT,
                                      env=child_env({"FLYWHEEL_RUN_TOKEN": TOKEN})))

    yield cfg, start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


async def test_episodes_of_kind_reward_model_get_the_reward_models_scores(run):
    cfg, start = run
    start("environment")
    security = SecurityConfig(run_token=TOKEN)
    async with channel(cfg.addresses.environment, security=security) as ch:
        env = environment_pb2_grpc.EnvironmentServiceStub(ch)
        listed = await env.List(environment_pb2.ListRequest(), timeout=60, wait_for_ready=True)
        assert "reward_model" in listed.builtin_kinds
        # Asked before the reward-model server is up: the call waits for it (it loads its model first).
        step = asyncio.ensure_future(env.Step(environment_pb2.StepRequest(
            env_name="reward_model", episodes=[_episode(*c) for c in CHATS]), timeout=110))
        await asyncio.sleep(1.0)
        assert not step.done()
        start("reward_model")
        results = (await step).results
    expected = RewardModel(cfg.env.reward_model, seed=cfg.run.seed).score(
        [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in CHATS])
    assert [r.error for r in results] == ["", "", ""]
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)
    assert all(r.terminated for r in results)


async def test_the_reward_model_server_refuses_bad_episodes_and_callers_without_the_token(run):
    cfg, start = run
    start("reward_model")
    async with channel(cfg.addresses.reward_model, security=SecurityConfig(run_token=TOKEN)) as ch:
        rm = environment_pb2_grpc.EnvironmentServiceStub(ch)
        for bad, why in [([], "episodes must not be empty"),
                         ([environment_pb2.Episode(messages=[types_pb2.ChatMessage(role="user", content="hi")])],
                          "episodes\\[0\\]: the last message must be the assistant's response")]:
            with pytest.raises(grpc.aio.AioRpcError, match=why) as err:
                await rm.Step(environment_pb2.StepRequest(env_name="reward_model", episodes=bad), timeout=110,
                              wait_for_ready=True)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with channel(cfg.addresses.reward_model) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await environment_pb2_grpc.EnvironmentServiceStub(ch).Step(
                environment_pb2.StepRequest(env_name="reward_model", episodes=[_episode("a", "b")]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_without_a_reward_model_the_kind_is_refused_with_the_setting_it_needs():
    server, port = await serve_environment()  # started from a config that names no reward model
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            env = environment_pb2_grpc.EnvironmentServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError, match="needs env.reward_model.model_name") as err:
                await env.Register(environment_pb2.RegisterRequest(name="rm", kind="reward_model"), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "reward_model" not in (await env.List(environment_pb2.ListRequest(), timeout=10)).builtin_kinds
    finally:
        await server.stop(0)
