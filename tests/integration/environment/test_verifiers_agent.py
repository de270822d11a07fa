"""VerifiersAgent for real: a verifiers 0.4 environment with an MCP tool (verifiers_add_env.py, written with the
real package), run in the verifiers venv by the agent's runner, its one rollout calling Flywheel's endpoint (uvicorn
on a free port, the hf engine with the tiny model after a version-0 weight sync). What the endpoint recorded is the
oracle: its samples must hold the prompt verifiers built (tools included), and the reward must be the rubric's rule
applied here, independently, to the reply the endpoint sampled.

Needs `.venv-verifiers` (`make verifiers`, part of `make setup`); verifiers prepares its chat program with `uv`
on the first episode (its packages are fetched once, then cached)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from needs import require
from services.common.config import load_config
from services.environment.agents import AgentEpisode, AgentError
from services.environment.agents.verifiers_agent import DEFAULT_PYTHON, TASK_KEY, VerifiersAgent, verifiers_rows
from services.rollout.endpoint.server import EndpointServer

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from engine_harness import policy, serving  # noqa: E402

ASYNC = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.slow
require(DEFAULT_PYTHON.exists(), "no .venv-verifiers: run `make verifiers`")
HERE = Path(__file__).parent
HANG_S = 601.25
SPEC = {"env": {"taskset": {"id": "verifiers_add_env", "n": 2},
                "agent": {"harness": {"id": "null"}, "max_turns": 2}},
        "pythonpath": [str(HERE)]}
# The tiny model's template, listing the request's tools first, so the recorded prompt shows what verifiers sent.
TEMPLATE = ("{{ bos_token }}{% if tools %}s:tools {{ tools | map(attribute='function.name') | join(',') }}"
            "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def endpoint():
    cfg = load_config(None, ["policy.generation.backend=hf", "policy.max_total_sequence_length=400",
                             "policy.generation.max_new_tokens=8"])
    async with serving(cfg, "verifiers-test", policy(cfg, seed=cfg.run.seed), TEMPLATE) as (server, engine):
        yield server, engine.tokenizer


@pytest.fixture(scope="module")
def rows():
    return verifiers_rows(SPEC)


def episode_of(server: EndpointServer, row: dict, deadline_s: float = 180.0) -> tuple[str, AgentEpisode]:
    key, token, base_url = server.open_episode(metadata={"group_id": "verifiers"})
    return key, AgentEpisode(base_url=base_url, api_key=token, model="policy", task=row, deadline_s=deadline_s)


def with_task(row: dict, **update) -> dict:
    return {**row, TASK_KEY: {**row[TASK_KEY], **update}}


def last_run(mask: list[bool]) -> slice:
    """The last stretch of generated tokens: the final reply."""
    end = len(mask) - mask[::-1].index(True)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return slice(start, end)


def test_rows_are_the_taskset_as_prompts(rows):
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": f"what is {i} + {i + 2}? use the add tool."}]
                                             for i in range(2)]
    assert [(r[TASK_KEY]["a"], r[TASK_KEY]["b"]) for r in rows] == [(0, 2), (1, 3)]


@ASYNC
async def test_episode_calls_the_endpoint_and_scores_with_the_rubric(endpoint, rows):
    server, tokenizer = endpoint
    key, episode = episode_of(server, rows[1])
    result = await VerifiersAgent(**SPEC).run(episode)
    trajectory = server.close_episode(key)

    assert trajectory.samples and trajectory.calls >= 1
    sample = trajectory.samples[-1]
    first = sample.generated_mask.index(True)
    prompt = tokenizer.decode(sample.token_ids[:first])
    assert re.search(r"s:tools \S*add", prompt), prompt  # verifiers offered its MCP tool
    assert "u:what is 1 + 3? use the add tool.\na:" in prompt
    reply = tokenizer.decode(sample.token_ids[last_run(sample.generated_mask)], skip_special_tokens=True)
    numbers = re.findall(r"-?\d+", reply)
    expected = float(bool(numbers) and int(numbers[-1]) == 4)
    assert result.reward == expected
    assert result.metrics == {"reply_chars": float(len(reply)), "reward/correct": expected}


@ASYNC
async def test_a_crashing_rubric_is_an_agent_error(endpoint, rows):
    server, _ = endpoint
    key, episode = episode_of(server, with_task(rows[0], crash=True))
    with pytest.raises(AgentError, match="the rubric crashed"):
        await VerifiersAgent(**SPEC).run(episode)
    server.close_episode(key)


@ASYNC
async def test_a_nan_reward_is_an_agent_error(endpoint, rows):
    server, _ = endpoint
    key, episode = episode_of(server, with_task(rows[0], nan=True))
    with pytest.raises(AgentError, match="malformed reward"):
        await VerifiersAgent(**SPEC).run(episode)
    server.close_episode(key)


def env_processes() -> list[psutil.Process]:
    """The runner, the env's tool server (`python -m verifiers_add_env`) and the program its hung rubric runs
    (`sleep 601.25`, which does not die with its parent), by their command lines; only this test process's own
    (below it, or orphaned, as the killed episode's are), not those of a run another test worker has going."""
    found = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        line = " ".join(p.info["cmdline"] or [])
        if "verifiers_runner.py" in line or "-m verifiers_add_env" in line or line == f"sleep {HANG_S}":
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.info["ppid"] == 1 or os.getpid() in {a.pid for a in p.parents()}:
                    found.append(p)
    return found


@ASYNC
@pytest.mark.timeout(300)
async def test_the_deadline_kills_the_episode_and_what_it_started(endpoint, rows):
    server, _ = endpoint
    key, episode = episode_of(server, with_task(rows[0], hang_s=HANG_S), deadline_s=40.0)
    with pytest.raises(AgentError, match="deadline"):
        await VerifiersAgent(**SPEC).run(episode)
    server.close_episode(key)
    # SIGKILL is sent to the episode's process group; the tool server (its own session, as verifiers starts MCP
    # servers) exits on its stdin's EOF, which took over 5 s on a loaded machine.
    for _ in range(300):
        if not [p for p in env_processes() if p.status() != psutil.STATUS_ZOMBIE]:
            break
        time.sleep(0.1)
    assert [p.info["cmdline"] for p in env_processes() if p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_missing_taskset_id_is_refused():
    with pytest.raises(ValueError, match="taskset.id"):
        VerifiersAgent(env={"taskset": {}})


SHARED = {**SPEC, "runner": "shared",
          "env": {**SPEC["env"], "taskset": {**SPEC["env"]["taskset"], "task": {"shared_tool": True}}}}


@ASYNC
@pytest.mark.timeout(300)
async def test_a_shared_runner_serves_concurrent_episodes_past_a_hung_and_a_crashing_one(endpoint, rows):
    server, tokenizer = endpoint
    agent = VerifiersAgent(**SHARED)
    hung_key, hung = episode_of(server, with_task(rows[0], hang_s=HANG_S), deadline_s=40.0)
    crash_key, crash = episode_of(server, with_task(rows[0], crash=True))
    opened = [episode_of(server, rows[i % 2]) for i in range(3)]
    try:
        results = await asyncio.gather(agent.run(hung), agent.run(crash), *[agent.run(e) for _, e in opened],
                                       return_exceptions=True)
        runners = [p for p in env_processes() if "verifiers_runner.py" in " ".join(p.info["cmdline"])]
    finally:
        await agent.close()
    assert isinstance(results[0], AgentError) and "deadline" in str(results[0])
    assert isinstance(results[1], AgentError) and "the rubric crashed" in str(results[1])
    assert len(runners) == 1  # every episode went to the one runner
    for (key, episode), result in zip(opened, results[2:]):
        sample = server.close_episode(key).samples[-1]
        reply = tokenizer.decode(sample.token_ids[last_run(sample.generated_mask)], skip_special_tokens=True)
        numbers = re.findall(r"-?\d+", reply)
        a, b = episode.task[TASK_KEY]["a"], episode.task[TASK_KEY]["b"]
        assert result.reward == float(bool(numbers) and int(numbers[-1]) == a + b)
    server.close_episode(hung_key)
    server.close_episode(crash_key)
