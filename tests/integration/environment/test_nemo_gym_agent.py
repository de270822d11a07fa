"""NeMo Gym's own servers, from the `nemo-gym` package in `.venv-gym`, run episodes on Flywheel's endpoint.

ng_run starts NeMo RL's `gdpo_example_tool_call_multireward.yaml` servers (`vllm_model_for_training` and
`example_tool_call_multireward` with its `simple_agent`) plus `equivalence_rule` (a dense text-similarity
reward, so the tiny model's answers score above zero). The endpoint serves the tiny model through the hf
engine, as in tests/integration/rollout/test_endpoint.py. Oracles: the endpoint's own recording of each
episode, and the reward NeMo Gym's resources server gives when this test calls its /verify with the recorded
answer. A thinking model's reply with its reasoning apart (the endpoint's reasoning parser) is taken by NeMo Gym's
model server (`uses_reasoning_parser: true`), whose /verify scores the answer after it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from engine_harness import policy, serving  # noqa: E402
from tool_demos import END_THINK, THINK, thinking_config, thinking_model  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.common.modeling import load_policy  # noqa: E402
from services.environment.agents import AgentEpisode, AgentError, AgentResult  # noqa: E402
from services.common.nemo_rl_gym import nemo_rl_agent_spec  # noqa: E402
from services.environment.agents.nemo_gym import NemoGymAgent, to_result  # noqa: E402
from services.environment.agents.nemo_gym_tasks import read_tasks  # noqa: E402
from services.environment.agents.registry import UnknownAgent, make_agent  # noqa: E402
from services.rollout.endpoint.server import EndpointServer  # noqa: E402
from needs import require  # noqa: E402

VENV = Path(__file__).parents[3] / ".venv-gym"
require((VENV / "bin" / "ng_run").exists(), "no .venv-gym: run `make gym-venv`")
pytestmark = pytest.mark.asyncio(loop_scope="module")
# NeMo RL's example at commit 7ea279a, as fetched: its env.nemo_gym is what NeMo RL hands NeMo Gym.
NEMO_RL = Path(__file__).parents[2] / "fixtures" / "nemo_rl" / "gdpo_example_tool_call_multireward.yaml"
EQUIVALENCE = "resources_servers/equivalence_rule/configs/lc.yaml"
# The tiny model writes letters at random: any of them scores above zero under seq_match against this.
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# Messages and tools as the tiny template renders them (test_endpoint.py's template, one letter per role).
TEMPLATE = ("{{ bos_token }}{% if tools %}s:tools {{ tools | map(attribute='function.name') | join(',') }}"
            "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['role'][0] }}:"
            "{% if m['role'] == 'assistant' %}[{{ m['content'] }}]{{ eos_token }}"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def endpoint():
    cfg = load_config(None, ["policy.generation.backend=hf", "policy.max_total_sequence_length=512",
                             "policy.generation.max_new_tokens=8"])
    async with serving(cfg, "gym-test", policy(cfg, seed=cfg.run.seed), TEMPLATE) as served:
        yield served


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinking_endpoint(tmp_path_factory):
    """The endpoint with vLLM's deepseek_r1 reasoning parser, serving a tiny model taught to think first."""
    cfg = thinking_config(thinking_model(tmp_path_factory.mktemp("thinking_model")), 512)
    async with serving(cfg, "gym-thinking", load_policy(cfg.policy, cfg.run.seed)[0], TEMPLATE) as served:
        yield served


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gym():
    spec = nemo_rl_agent_spec(yaml.safe_load(NEMO_RL.read_text())["env"]["nemo_gym"])
    spec["config_paths"].append(EQUIVALENCE)
    spec["overrides"]["lc_equivalence_rule"] = {
        "resources_servers": {"equivalence_rule": {"grading_rule": "seq_match"}}}
    agent = make_agent(spec | {"venv": str(VENV)})  # as the environment service builds it from a spec
    await agent.start()
    yield agent
    await agent.close()
    assert await group_gone(agent.proc.pid)  # nothing ng_run started in its session outlives close()


async def group_gone(pgid: int) -> bool:
    """Whether the process group is empty, after the moment killed processes take to be reaped."""
    for _ in range(100):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.1)
    return False


def multireward_tasks(agent: NemoGymAgent) -> list[dict]:
    site = next(VENV.glob("lib/python3*/site-packages"))
    rows = read_tasks(site / "resources_servers/example_tool_call_multireward/data/example.jsonl")[:2]
    for row in rows:
        row["nemo_gym"]["agent_ref"] = {"type": "responses_api_agents",
                                        "name": "example_tool_call_multireward_simple_agent"}
    return rows


def equivalence_task(word: str) -> dict:
    return {"nemo_gym": {"responses_create_params": {"input": [{"role": "user", "content": f"say {word}"}]},
                         "expected_answer": ALPHABET,
                         "agent_ref": {"type": "responses_api_agents",
                                       "name": "lc_equivalence_rule_simple_agent"}}}


async def run_episode(server: EndpointServer, agent: NemoGymAgent, task: dict, deadline_s: float = 120.0):
    key, token, base_url = server.open_episode(metadata={"group_id": "gym"})
    try:
        result = await agent.run(AgentEpisode(base_url=base_url, api_key=token, model="policy", task=task,
                                              deadline_s=deadline_s))
    finally:
        trajectory = server.close_episode(key)
    return result, trajectory


async def reference_verify(agent: NemoGymAgent, resources_server: str, row: dict, text: str) -> dict:
    """The resources server's own /verify on the answer the endpoint recorded."""
    output = [{"type": "message", "role": "assistant", "id": "msg_ref", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
    response = {"id": "resp_ref", "created_at": 0, "model": "policy", "object": "response", "output": output,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    async with aiohttp.ClientSession() as http:
        url = f"{agent.servers[resources_server]}/verify"
        async with http.post(url, json=row | {"response": response}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def recorded_answer(engine, trajectory) -> tuple[str, str]:
    """(prompt, answer) of an episode's one recorded call, decoded from the endpoint's sample."""
    [sample] = trajectory.samples
    assert sample.calls == 1
    prompt = [t for t, m in zip(sample.token_ids, sample.generated_mask) if not m]
    answer = [t for t, m in zip(sample.token_ids, sample.generated_mask) if m]
    assert answer and all(v == 0 for v, m in zip(sample.versions, sample.generated_mask) if m)
    return engine.tokenizer.decode(prompt), engine.tokenizer.decode(answer, skip_special_tokens=True)


async def test_concurrent_episodes_are_recorded_and_scored_as_nemo_gyms_verify_scores_them(endpoint, gym):
    server, engine = endpoint
    tasks = [equivalence_task("red"), equivalence_task("blue")]
    results = await asyncio.gather(*(run_episode(server, gym, task) for task in tasks))
    for task, (result, trajectory) in zip(tasks, results):
        prompt, answer = recorded_answer(engine, trajectory)
        assert task["nemo_gym"]["responses_create_params"]["input"][0]["content"] in prompt  # its own task
        reference = await reference_verify(gym, "lc_equivalence_rule", task["nemo_gym"], answer)
        assert result.reward == pytest.approx(reference["reward"]) and reference["reward"] > 0
        assert result.metrics == {"equivalence_score": pytest.approx(reference["equivalence_score"])}


async def test_a_thinking_models_reasoning_reaches_nemo_gym_apart_from_the_answer_it_scores(thinking_endpoint, gym):
    """NeMo Gym's model server takes a reply whose reasoning comes apart (vLLM's `reasoning` field) and /verify
    scores the answer after it, as the recorded text splits at the tags. (It would split tags left in the content
    too: what the parser changes for training is which text a turn's flaws are judged on, and that a reply sent
    back with its reasoning continues the recorded tokens; tests/integration/rollout/test_endpoint_reasoning.py.)"""
    server, engine = thinking_endpoint
    task = equivalence_task("add")
    result, trajectory = await run_episode(server, gym, task)
    _, text = recorded_answer(engine, trajectory)
    reasoning, closed, answer = text.removeprefix(THINK).partition(END_THINK)
    assert reasoning and text.startswith(THINK), text  # it thought
    scored = await reference_verify(gym, "lc_equivalence_rule", task["nemo_gym"], answer if closed else "")
    whole = await reference_verify(gym, "lc_equivalence_rule", task["nemo_gym"], text)
    assert scored["reward"] != whole["reward"]  # the two readings score apart, so the check below tells them apart
    assert result.reward == pytest.approx(scored["reward"])


async def test_nemo_rl_multireward_config_gives_verify_reward_and_components_as_metrics(endpoint, gym):
    server, engine = endpoint
    for task in multireward_tasks(gym):
        result, trajectory = await run_episode(server, gym, task)
        prompt, answer = recorded_answer(engine, trajectory)
        # The tools reached the template; the tiny vocabulary has no capitals, so compare the task's tail.
        assert prompt.startswith("<bos>s:tools get_weather\n")
        assert task["messages"][-1]["content"][-6:] in prompt
        reference = await reference_verify(gym, "example_tool_call_multireward", task["nemo_gym"], answer)
        assert result.reward == pytest.approx(reference["reward"])
        components = ("correctness", "schema_valid", "format")
        assert result.metrics == {k: pytest.approx(reference[k]) for k in components}


async def test_an_episode_past_its_deadline_fails_and_its_late_calls_find_no_route(endpoint, gym):
    server, _ = endpoint
    with pytest.raises(AgentError, match="deadline") as failed:
        await run_episode(server, gym, equivalence_task("late"), deadline_s=0.01)
    assert failed.value.reason == "deadline"
    assert gym.routes == {}
    # What NeMo Gym's model server would send for that episode now: refused by the pass-through.
    async with aiohttp.ClientSession() as http:
        call = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"flywheel_episode": "gone"}}
        async with http.post(f"{gym.servers['policy_model']}/v1/chat/completions", json=call) as r:
            assert r.status != 200 and "no open Flywheel episode" in await r.text()


@pytest.mark.parametrize("reward", [None, "1.0", True, float("nan"), float("inf")])
async def test_a_malformed_verify_reward_fails_the_episode(reward):
    with pytest.raises(AgentError, match="malformed reward") as failed:
        to_result({"reward": reward, "correctness": 1.0}, {})
    assert failed.value.reason == "malformed_reward"


async def test_a_spec_without_config_paths_or_venv_is_refused_by_the_registry():
    with pytest.raises(UnknownAgent, match="config_paths"):
        make_agent({"type": "nemo_gym", "config_paths": [], "venv": str(VENV)})
    with pytest.raises(UnknownAgent, match="no NeMo Gym"):
        make_agent({"type": "nemo_gym", "config_paths": ["a.yaml"], "venv": "/nonexistent"})


async def test_metrics_are_verifys_numbers_the_task_row_did_not_bring():
    verified = {"reward": 2, "format": 1.0, "expected_call": {}, "task_id": 7, "ok": True, "note": "x"}
    assert to_result(verified, {"task_id": 7}) == AgentResult(reward=2.0, metrics={"format": 1.0})
