"""Agent groups for real: the hf engine with the tiny model behind the worker's endpoint, the environment service's
AgentService over gRPC, and tests/fixtures/agents/copy_agent.py (the real `openai` SDK) as the agent. The oracle
for what a group trains on is the tokenizer, outside the endpoint's recording: the prompt's chat template and the
decoded answer the agent scored."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from engine_harness import Trainer, policy
from environment_service import serve_environment
from prometheus_client import REGISTRY

from services.common.config import load_config
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.structs import to_struct
from services.rollout.agent_groups import AgentFailed, AgentGroups
from services.rollout.endpoint.server import EndpointServer
from services.rollout.engines import make_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
AGENT = Path(__file__).parents[2] / "fixtures" / "agents" / "copy_agent.py"
G = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world():
    """(AgentGroups, endpoint, engine, AgentService stub) around one engine at version 0."""
    cfg = load_config(None, ["policy.generation.backend=hf", "policy.max_total_sequence_length=96",
                             "policy.generation.max_new_tokens=3", "rollout.step_timeout_s=60"])
    engine = make_engine(cfg, "agent-test")
    await engine.start()
    trainer = Trainer("agent-test")
    await trainer.push(engine, 0, policy(cfg, seed=cfg.run.seed))
    endpoint = EndpointServer(cfg, engine, "agent-test")
    await endpoint.start()
    server, port = await serve_environment()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = environment_pb2_grpc.AgentServiceStub(channel)
    yield AgentGroups(stub, model="tiny", step_timeout_s=60), endpoint, engine, stub
    await channel.close()
    await server.stop(0)
    await endpoint.stop()
    trainer.close()
    await engine.close()


async def register(stub, name: str, *args: str, timeout: float = 0.0) -> None:
    spec = {"type": "program", "command": [sys.executable, str(AGENT), *args]}
    await stub.RegisterAgent(environment_pb2.RegisterAgentRequest(name=name, agent=to_struct(spec),
                                                                  timeout_seconds=timeout))


def prompt_group(env: str, digit: int = 3) -> types_pb2.PromptGroup:
    return types_pb2.PromptGroup(
        group_id=f"g-{env}-{digit}", prompt_id=f"p{digit}", env_name=env, num_generations=G, target_step=0,
        messages=[types_pb2.ChatMessage(role="user", content=f"copy {digit}")],
        metadata=to_struct({"ground_truth": str(digit)}), max_turns=1, reward_scale=2.0)


def open_episodes() -> float:
    return REGISTRY.get_sample_value("flywheel_endpoint_open_episodes")


async def test_a_group_is_g_episodes_of_recorded_tokens_each_with_its_agents_reward(world):
    groups, endpoint, engine, stub = world
    await register(stub, "sum", "--reward", "checksum")
    assert await groups.is_agent("sum") and not await groups.is_agent("toy_copy")
    traj = await groups.run(prompt_group("sum"), endpoint, engine.version, "w")
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "copy 3"}], add_generation_prompt=True, tokenize=False)
    rendered = tok(text, add_special_tokens=False).input_ids
    assert len(traj.completions) == G and traj.env_name == "sum" and traj.version_start == 0
    for c in traj.completions:
        ids = list(traj.prompt_token_ids) + list(c.token_ids)
        assert ids[:len(rendered)] == list(rendered)  # the prompt exactly as the template renders it
        generated = [t for t, m in zip(c.token_ids, c.generated_mask) if m]
        assert generated and len(generated) == sum(c.generated_mask) and c.turns == 1
        answer = tok.decode(generated, skip_special_tokens=True)
        assert c.reward == 2.0 * (sum(map(ord, answer)) % 97)  # the agent's own scoring, times reward_scale
        assert all(lp < 0 for lp, m in zip(c.generation_logprobs, c.generated_mask) if m)
    assert open_episodes() == 0


async def test_an_agent_that_calls_twice_gives_every_call_to_the_group(world):
    groups, endpoint, engine, stub = world
    await register(stub, "copy2", "--calls", "2")
    traj = await groups.run(prompt_group("copy2"), endpoint, engine.version, "w")
    # One sample per episode when the second call extends the first, else two: every call is trained either way.
    assert len(traj.completions) >= G and sum(c.turns for c in traj.completions) == 2 * G


@pytest.mark.parametrize("fault, reason", [("hang", "deadline"), ("crash", "crash"),
                                           ("malformed", "malformed_reward")])
async def test_a_failed_episode_fails_its_group_counted_and_leaves_no_episode_open(world, fault, reason):
    groups, endpoint, engine, stub = world
    await register(stub, "copy")
    await register(stub, f"f-{fault}", "--fault", fault, timeout=3.0 if fault == "hang" else 40.0)
    labels = {"env": f"f-{fault}", "reason": reason}
    before = REGISTRY.get_sample_value("flywheel_rollout_agent_groups_failed_total", labels) or 0.0
    with pytest.raises(AgentFailed) as err:
        await groups.run(prompt_group(f"f-{fault}"), endpoint, engine.version, "w")
    assert err.value.reason == reason
    assert REGISTRY.get_sample_value("flywheel_rollout_agent_groups_failed_total", labels) == before + 1
    assert open_episodes() == 0
    traj = await groups.run(prompt_group("copy"), endpoint, engine.version, "w")  # and the next group trains
    assert len(traj.completions) == G


async def test_calls_after_the_episode_ended_are_refused_and_reach_no_other_episode(world, tmp_path):
    groups, endpoint, engine, stub = world
    log = tmp_path / "late.log"
    await register(stub, "late", "--fault", "late", "--late-log", str(log))
    await register(stub, "copy")
    first = await groups.run(prompt_group("late"), endpoint, engine.version, "w")
    assert len(first.completions) == G
    Path(f"{log}.go").touch()  # the escaped children start calling now that their episodes have closed
    # The next group's episodes run while the escaped children keep calling with their old sessions.
    second = await groups.run(prompt_group("copy", digit=1), endpoint, engine.version, "w")
    for _ in range(200):
        statuses = log.read_text().split() if log.exists() else []
        if len(statuses) == 5 * G:
            break
        await asyncio.sleep(0.1)
    assert statuses == ["410"] * (5 * G)
    assert [c.turns for c in second.completions] == [1] * G  # only its own agents' calls
    assert open_episodes() == 0


async def test_generate_runs_a_failed_episode_again_and_fails_only_after_its_last_attempt(world, tmp_path):
    """Generate's episodes (eval, collect, validation) are tried up to `attempts` times each. The oracles are the
    agent's own: its marker of the crash it made, and its log of the model calls it made."""
    groups, endpoint, engine, stub = world
    await register(stub, "flaky", "--crash-first", str(tmp_path))  # each task's first episode crashes
    flaky = prompt_group("flaky")
    flaky.metadata.update({"crash_first": True})
    completions = await groups.completions(flaky, endpoint, engine.version, engine.tokenizer.decode, attempts=3)
    assert (tmp_path / "copy_3").exists() and len(completions) == G and all(c.token_ids for c in completions)
    record = tmp_path / "calls.jsonl"
    await register(stub, "always", "--fault", "crash", "--record", str(record))  # crashes after its model call
    lone = prompt_group("always")
    lone.num_generations = 1
    with pytest.raises(AgentFailed) as err:
        await groups.completions(lone, endpoint, engine.version, engine.tokenizer.decode, attempts=2)
    assert err.value.reason == "crash" and len(record.read_text().splitlines()) == 2
    assert open_episodes() == 0


async def test_an_agents_calls_sample_with_its_environments_sampling_where_they_leave_it_out(world, tmp_path):
    """The environment's max_new_tokens (1) over policy.generation's (3), as the built-in loop's turns take it;
    the oracle is the agent's own log of the token ids each reply carried."""
    groups, endpoint, engine, stub = world
    record = tmp_path / "calls.jsonl"
    await register(stub, "short", "--record", str(record))
    group = prompt_group("short")
    group.sampling.max_new_tokens = 1
    await groups.run(group, endpoint, engine.version, "w")
    lengths = [len(json.loads(line)["tokens"]) for line in record.read_text().splitlines()]
    assert lengths == [1] * G
