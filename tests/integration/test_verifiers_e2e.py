"""A `verifiers` environment trains through `flywheel up`: verifiers_add_env.py (written with the real package, an
`add` MCP tool and a rubric rewarding the right sum) is an environment of the config's mix with no dataset; the
controller leases the taskset's rows, which the environment service lists by running the env in the verifiers
venv (Prompts), and each episode runs in that venv through VerifiersAgent against the rollout worker's endpoint.

The oracle is verifiers' own side of each episode: the env's rubric appends the reply its client got back from the
model and the reward it gave (the taskset's `record`). Every completion of the batches the trainer consumed
(replay's chosen groups in Redis) must be one of those replies, on its task's prompt, and carry the reward the
rule gives that reply (the last number equals a + b), checked here independently.

Needs `.venv-verifiers` (`make verifiers`). Each episode starts a fresh Python with verifiers and its tool server
(about 4 s each on an idle 2-core machine), so the run is 2 steps of 2 prompts x 2 episodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from needs import require
from oracles import consumed_groups
from services.common.config import load_config
from services.common.jsonl import read_rows
from services.common.tokenizing import load_tokenizer_without_torch
from services.environment.agents.verifiers_agent import DEFAULT_PYTHON
from services.local import LocalStack

pytestmark = pytest.mark.slow
require(DEFAULT_PYTHON.exists(), "no .venv-verifiers: run `make verifiers`")
ENV_DIR = Path(__file__).parent / "environment"  # verifiers_add_env.py
STEPS = 2
PROMPT = re.compile(r"what is (\d+) \+ (\d+)\? use the add tool\.")


def _write(tmp_path: Path) -> Path:
    agent = {"type": "verifiers", "pythonpath": [str(ENV_DIR)],
             "env": {"taskset": {"id": "verifiers_add_env", "n": 4,
                                 "task": {"record": str(tmp_path / "episodes.jsonl")}},
                     "agent": {"harness": {"id": "null"}, "max_turns": 2}}}
    config = tmp_path / "verifiers.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": "tiny", "max_total_sequence_length": 400,  # the prompt holds the tool schema
                   "generation": {"backend": "hf", "max_new_tokens": 8}},
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": STEPS,
                 "val_period": 0, "val_at_start": False},
        "environments": [{"name": "add", "kind": "agent", "timeout_s": 240, "agent": agent}],
        "checkpointing": {"enabled": False}}))
    return config


def _rule(reply: str, a: int, b: int) -> float:
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


def test_a_verifiers_environment_trains_through_flywheel_up(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert cfg.policy.generation.endpoint.enabled  # turned on by the agent in the mix
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
        groups = consumed_groups(stack.redis.url, stack.cfg)
    assert all("train/reward_mean/add" in r for r in rows)
    assert len(groups) >= STEPS * cfg.grpo.num_prompts_per_step and all(g.env_name == "add" for g in groups)
    tokenizer = load_tokenizer_without_torch(cfg.policy)
    episodes = [(e["a"], e["b"], e["reply"], e["reward"]) for e in read_rows(tmp_path / "episodes.jsonl")]
    seen_tasks = set()
    for g in groups:
        a, b = map(int, PROMPT.search(tokenizer.decode(g.prompt_token_ids)).groups())  # a taskset row's prompt
        seen_tasks.add((a, b))
        assert b == a + 2 and len(g.completions) == cfg.grpo.num_generations_per_prompt
        for c in g.completions:
            assert sum(c.generated_mask) > 0
            reply = tokenizer.decode([t for t, m in zip(c.token_ids, c.generated_mask) if m], skip_special_tokens=True)
            assert (a, b, reply, c.reward) in episodes  # the reply verifiers got back, scored by its rubric
            assert c.reward == _rule(reply, a, b)
    assert len(seen_tasks) >= 2  # the controller walked the taskset, not one row
