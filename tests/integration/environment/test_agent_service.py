"""AgentService in the environment service over real gRPC: program agents (real subprocesses) register, run under
their deadline and report rewards; each failure is an answer with its reason, counted, and the service goes on."""

from __future__ import annotations

import json
import os
import sys
import time

import grpc
import pytest
from environment_service import serve_environment
from prometheus_client import REGISTRY

from services.common.config import FlywheelConfig
from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import controller_pb2, environment_pb2, environment_pb2_grpc, types_pb2
from services.common.structs import to_struct
from services.controller.registry import Registry

ECHO = ("import json, os, sys; t = json.load(open(os.environ['FLYWHEEL_TASK_FILE'])) if 'FLYWHEEL_TASK_FILE' in "
        "os.environ else json.load(sys.stdin); print('a log line'); print(json.dumps({'reward': 0.5, 'metrics': {"
        "'env_ok': float(os.environ['OPENAI_BASE_URL'] == 'http://h:1/sessions/k/v1' and os.environ['OPENAI_API_KEY']"
        " == 'tok' and os.environ['OPENAI_MODEL'] == 'm'), 'truth': float(t['ground_truth']), "
        "'messages': float(len(t['messages']))}}))")


@pytest.fixture
async def stubs():
    server, port = await serve_environment()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield environment_pb2_grpc.AgentServiceStub(channel), environment_pb2_grpc.EnvironmentServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def register(agents, name: str, code: str, timeout: float = 0.0, **fields) -> None:
    spec = {"type": "program", "command": [sys.executable, "-c", code], **fields}
    await agents.RegisterAgent(environment_pb2.RegisterAgentRequest(name=name, agent=to_struct(spec),
                                                                    timeout_seconds=timeout))


async def run(agents, name: str) -> environment_pb2.RunAgentResponse:
    task = {"messages": [{"role": "user", "content": "copy 3"}], "ground_truth": "3"}
    return await agents.RunAgent(environment_pb2.RunAgentRequest(
        env_name=name, base_url="http://h:1/sessions/k/v1", api_key="tok", model="m", task_json=json.dumps(task)))


def failures(name: str, reason: str) -> float:
    return REGISTRY.get_sample_value("flywheel_agent_episodes_failed_total", {"env": name, "reason": reason}) or 0.0


@pytest.mark.parametrize("task_file", [False, True])
async def test_program_gets_the_episode_and_task_and_its_last_line_is_the_reward(stubs, task_file):
    agents, _ = stubs
    await register(agents, "echo", ECHO, task_file=task_file)
    r = await run(agents, "echo")
    assert (r.error, r.reward) == ("", 0.5)
    assert dict(r.metrics) == {"env_ok": 1.0, "truth": 3.0, "messages": 1.0}


async def test_agent_environment_is_listed_described_and_refused_by_step(stubs):
    agents, envs = stubs
    await register(agents, "echo", ECHO)
    await register(agents, "echo", ECHO)  # the same spec again: a restarted controller's
    listed = await envs.List(environment_pb2.ListRequest())
    assert listed.registered["echo"] == "agent:program"
    kind = lambda n: agents.DescribeEnvironment(environment_pb2.DescribeEnvironmentRequest(env_name=n))
    assert (await kind("echo")).agent_type == "program"
    assert (await kind("toy_copy")).agent_type == ""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await envs.Step(environment_pb2.StepRequest(env_name="echo", episodes=[environment_pb2.Episode()]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(agents, "echo", "print(1)")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_built_in_kinds_name_serves_only_that_kind(stubs):
    agents, envs = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(agents, "toy_copy", ECHO)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await envs.Register(environment_pb2.RegisterRequest(name="math", kind="toy_copy"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await envs.Register(environment_pb2.RegisterRequest(name="math", kind="math"))  # its own kind: allowed
    step = await envs.Step(environment_pb2.StepRequest(env_name="toy_copy", episodes=[environment_pb2.Episode(
        messages=[types_pb2.ChatMessage(role="user", content="copy 3"),
                  types_pb2.ChatMessage(role="assistant", content="3")], metadata={"ground_truth": "3"})]))
    assert [r.reward for r in step.results] == [1.0]
    assert (await envs.List(environment_pb2.ListRequest())).registered["math"] == "builtin:math"


@pytest.mark.parametrize("spec", [{"type": "nope"}, {"type": "program", "command": []},
                                  {"type": "program", "command": ["x"], "unknown": 1}, {}])
async def test_a_bad_agent_spec_is_invalid_argument(stubs, spec):
    agents, _ = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agents.RegisterAgent(environment_pb2.RegisterAgentRequest(name="bad", agent=to_struct(spec)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_agent_past_its_deadline_fails_and_its_process_is_killed(stubs, tmp_path):
    agents, _ = stubs
    pid_file = tmp_path / "pid"
    await register(agents, "hang", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                   "time.sleep(600)", timeout=1.0)
    before = failures("hang", "deadline")
    t0 = time.monotonic()
    r = await run(agents, "hang")
    assert r.error_reason == "deadline" and r.reward == 0 and time.monotonic() - t0 < 30
    assert failures("hang", "deadline") == before + 1
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed at once; reaped by asyncio's child watcher
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung agent {pid} is still alive")


@pytest.mark.parametrize("code, reason", [
    ("import sys; print('boom', file=sys.stderr); sys.exit(3)", "crash"),
    ("print('{\"reward\": \"high\"}')", "malformed_reward"),
    ("print('{\"reward\": NaN}')", "malformed_reward"),
    ("print('{\"reward\": 1, \"metrics\": {\"x\": \"y\"}}')", "malformed_reward"),
    ("print('done')", "malformed_reward"),
    ("pass", "malformed_reward"),
])
async def test_a_failed_agent_is_an_answer_with_its_reason_and_the_service_goes_on(stubs, code, reason):
    agents, _ = stubs
    await register(agents, "bad", code)
    before = failures("bad", reason)
    r = await run(agents, "bad")
    assert r.error_reason == reason and r.error and r.reward == 0
    assert failures("bad", reason) == before + 1
    await register(agents, "echo", ECHO)
    assert (await run(agents, "echo")).reward == 0.5
    if reason == "crash":
        assert "boom" in r.error


def registry_for(port: int, endpoint: bool) -> Registry:
    return Registry(FlywheelConfig.model_validate({
        "addresses": {"environment": f"127.0.0.1:{port}"}, "environments": [{"name": "toy", "kind": "toy_copy"}],
        "policy": {"generation": {"endpoint": {"enabled": endpoint}}}}))


async def test_the_controller_submits_an_agent_environment_and_refuses_one_without_the_endpoint():
    server, port = await serve_environment()
    spec = controller_pb2.EnvironmentSpec(
        name="agent", kind="agent", weight=1.0, timeout_seconds=5,
        rows=[types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content="copy 1")])],
        agent=to_struct({"type": "program", "command": [sys.executable, "-c", ECHO]}))
    try:
        without = registry_for(port, endpoint=False)
        with pytest.raises(InvalidArgument, match="policy.generation.endpoint.enabled"):
            await without.submit(spec)
        await without.close()
        registry = registry_for(port, endpoint=True)
        entry = await registry.submit(spec)
        assert entry.num_prompts == 1
        listed = await registry.env.List(environment_pb2.ListRequest())
        assert listed.registered["agent"] == "agent:program"
        bad = controller_pb2.EnvironmentSpec()
        bad.CopyFrom(spec)
        bad.name, bad.agent = "bad", to_struct({"type": "chess"})
        with pytest.raises(InvalidArgument, match="agent.type must be one of"):
            await registry.submit(bad)
        await registry.close()
    finally:
        await server.stop(0)
