"""A Flywheel episode written as a NeMo Gym rollout (to_gym.py) reads back as the same chat through
`flywheel data from-gym`'s reader, and NeMo Gym's own model of a rollouts.jsonl line accepts it."""

from __future__ import annotations

import json

from gym_schema import nemo_gym_reads

from services.common.data.from_gym import read_rollouts
from services.common.data.to_gym import gym_rollout

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
PROMPT = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOL_EPISODE = [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "content": "5", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "The answer is 5."}]
PLAIN_EPISODE = [{"role": "assistant", "content": "7"}, {"role": "environment", "content": "Environment: wrong"},
                 {"role": "assistant", "content": "5"}]


def _write(tmp_path, lines):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _line(episode, *, tools=TOOLS, reward=1.0, metrics=None, rollout_index=0):
    return gym_rollout(prompt=PROMPT, tools=tools, episode=episode, reward=reward, metrics=metrics or {},
                       env_name="calc", model="tiny", task_index=0, rollout_index=rollout_index)


def test_a_tool_episode_reads_back_through_from_gym_as_the_same_chat(tmp_path):
    rollouts, drops = read_rollouts(_write(tmp_path, [_line(TOOL_EPISODE, reward=0.5)]))
    assert drops == [] and len(rollouts) == 1
    r = rollouts[0]
    assert r.prompt == PROMPT and r.episode == TOOL_EPISODE and r.reward == 0.5
    assert r.tools == [{"type": "function", "function": {"name": "add", "description": "a + b",
                                                         "parameters": TOOLS[0]["function"]["parameters"]}}]


def test_output_items_are_responses_items_in_episode_order():
    output = _line(TOOL_EPISODE)["response"]["output"]
    assert [i["type"] for i in output] == ["function_call", "function_call_output", "message"]
    assert output[0]["call_id"] == output[1]["call_id"] == "call_1" and output[0]["name"] == "add"
    assert output[2]["role"] == "assistant" and output[2]["content"][0] == {
        "type": "output_text", "text": "The answer is 5.", "annotations": []}


def test_an_environment_observation_reads_back_as_the_users_turn(tmp_path):
    rollouts, drops = read_rollouts(_write(tmp_path, [_line(PLAIN_EPISODE, tools=None)]))
    assert drops == [] and rollouts[0].tools is None
    assert rollouts[0].episode == [PLAIN_EPISODE[0], {"role": "user", "content": "Environment: wrong"},
                                   PLAIN_EPISODE[2]]


def test_named_rewards_are_top_level_keys_and_never_replace_the_lines_own():
    line = _line(PLAIN_EPISODE, metrics={"reward/correctness": 1.0, "reward": 3.0})
    assert line["reward/correctness"] == 1.0 and line["metric/reward"] == 3.0 and line["reward"] == 1.0


def test_nemo_gyms_own_model_accepts_the_lines(tmp_path):
    path = _write(tmp_path, [_line(TOOL_EPISODE), _line(PLAIN_EPISODE, tools=None, reward=0.5, rollout_index=1)])
    assert nemo_gym_reads(path) == (2, 0.75)
