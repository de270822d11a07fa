"""`flywheel collect` on the tiny model with two built-in environments (toy_copy, and tool_add with vLLM's hermes
parser): the file has prompts × n lines, every line is read by `flywheel data from-gym`'s reader and accepted by
NeMo Gym's own model of a rollouts.jsonl line, and each reward is what the environment's class gives when the
episode is replayed through it turn by turn (the oracle, outside rollout and the environment service). With the
briefly supervised tiny model (slow: the session's tool_model, 75 s to make here) the tool calls come through as
function_call items."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gym_schema import nemo_gym_reads

from services.common.data.from_gym import read_rollouts
from services.environment.envs.tool_add import ToolAddEnvironment
from services.environment.envs.toy_copy import ToyCopyEnvironment

PROMPTS, N = 4, 3
ENVIRONMENTS = {"copy": ToyCopyEnvironment(), "calc": ToolAddEnvironment()}


def _replayed_reward(env, prompt: list[dict], episode: list[dict], metadata: dict) -> float:
    """The episode's reward as the environment scores each of its assistant turns, observations fed back."""
    reward, conversation = 0.0, list(prompt)
    for i, message in enumerate(episode):
        conversation.append(message)
        if message["role"] != "assistant":
            continue
        result = env.step([conversation], [metadata])[0]
        reward += result.reward
        metadata = result.metadata or metadata
        if result.messages and i + 1 < len(episode):
            assert episode[i + 1:i + 1 + len(result.messages)] == [
                {k: v for k, v in m.items() if k != "name"} for m in result.messages]
    return reward


def _ground_truth(prompt: list[dict]) -> dict:
    """toy_copy's "copy D" asks for D, tool_add's "add A B" for A + B: read back from the prompt itself."""
    words = prompt[-1]["content"].split()
    return {"ground_truth": words[1] if words[0] == "copy" else str(int(words[1]) + int(words[2]))}


def _collect(tmp_path, *args: str) -> list[dict]:
    """Runs `flywheel collect`; its lines, each checked against both readers and the environment's own score."""
    out = tmp_path / "rollouts.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "collect", "--n", str(N), "--out", str(out), "--run-dir",
         str(tmp_path / "run"), f"grpo.max_val_samples={PROMPTS}", "policy.generation.tool_parser=hermes", *args],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == PROMPTS * N
    rollouts, drops = read_rollouts(out)
    assert drops == [] and len(rollouts) == PROMPTS * N
    assert nemo_gym_reads(out) == (PROMPTS * N, pytest.approx(sum(line["reward"] for line in lines) / len(lines)))
    for line, r in zip(lines, rollouts, strict=True):
        env = ENVIRONMENTS[line["env_name"]]
        assert r.episode and r.episode[0]["role"] == "assistant"
        assert r.reward == _replayed_reward(env, r.prompt, r.episode, _ground_truth(r.prompt)), line
    return lines


def test_collect_writes_prompts_times_n_rollouts_that_both_readers_accept_with_the_environments_rewards(tmp_path):
    mix = "environments=[{name: copy, kind: toy_copy}, {name: calc, kind: tool_add, max_turns: 2}]"
    lines = _collect(tmp_path, mix)
    assert {line["env_name"] for line in lines} == {"copy", "calc"}
    assert all(line["responses_create_params"].get("tools") for line in lines if line["env_name"] == "calc")


@pytest.mark.slow
def test_collected_tool_calls_are_function_call_items_answered_by_the_tools_output(tmp_path, tool_model):
    """The briefly supervised tiny model (tests/tool_demos.py) calls add(a, b): each call the rollout worker's parser
    read is a function_call item, the tool's result a function_call_output with its call_id, then the answer."""
    lines = _collect(tmp_path, "--model", tool_model, "policy.max_total_sequence_length=256",
                     "policy.generation.max_new_tokens=80", "environments=[{name: calc, kind: tool_add, max_turns: 2}]")
    calls = [line for line in lines if line["response"]["output"][0]["type"] == "function_call"]
    assert calls, [line["response"]["output"] for line in lines]
    for line in calls:
        call, result = line["response"]["output"][:2]
        assert result["type"] == "function_call_output" and result["call_id"] == call["call_id"]
    assert 0 < sum(line["reward"] for line in lines) < len(lines)  # right and wrong answers both come through
