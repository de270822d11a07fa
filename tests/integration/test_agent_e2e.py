"""The three kinds of agent environment train in one `flywheel up` run beside a built-in one, each with its own
metrics: toy_copy; a program agent, tests/fixtures/agents/copy_agent.py (the real `openai` SDK), which answers toy
copy prompts through each rollout worker's endpoint and scores them with a checksum of its answer (a reward that
differs within a group from the first step on); a `verifiers` environment (environment/verifiers_add_env.py, the
real package, in its venv); and NeMo Gym's own simple agent and example_tool_call_multireward resources server
(ng_run from `.venv-gym`), on that server's example rows.

The oracles are the agents' own records against the batches the trainer consumed (replay's chosen groups in
Redis): the program agent's log of the token ids the endpoint answered it with, and verifiers' rubric's record of
the reply its client got back and the reward it gave. NeMo Gym's completions must carry its reward components
(test_nemo_gym_e2e.py checks their values against /verify). Some program-agent prompts make their first episode
crash: their groups fail, are handed back and run again, and the run goes on. With NeMo RL's advantage overrides
for flawed turns on, the trainer's turn counts are the consumed batches' (runs of generated tokens)."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest
import yaml

from needs import require
from oracles import consumed_groups
from services.common.config import load_config
from services.common.jsonl import read_rows
from services.common.nemo_rl_gym import gym_venv, nemo_rl_agent_spec
from services.common.tokenizing import load_tokenizer_without_torch
from services.environment.agents.verifiers_agent import DEFAULT_PYTHON
from services.local import LocalStack
from verifiers_add import ENV_DIR, rule

pytestmark = pytest.mark.slow
require(DEFAULT_PYTHON.exists(), "no .venv-verifiers: run `make verifiers`")
require((gym_venv() / "bin" / "ng_run").exists(), "no .venv-gym: run `make gym-venv`")
AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "copy_agent.py"
NEMO_RL = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "gdpo_example_tool_call_multireward.yaml"
STEPS = 4
ENVS = ("toy", "agent", "add", "gym")
"""8 groups a step drawn among 4 environments of equal weight: over 4 steps each is missed with chance 0.75^32."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gym_env() -> dict:
    """NeMo RL's example env.nemo_gym as a Flywheel agent environment on the resources server's example rows."""
    spec = nemo_rl_agent_spec(yaml.safe_load(NEMO_RL.read_text())["env"]["nemo_gym"])
    spec["overrides"]["head_server"] = {"host": "127.0.0.1", "port": _free_port()}
    site = next(gym_venv().glob("lib/python3*/site-packages"))
    return {"name": "gym", "kind": "agent", "timeout_s": 120, "agent": spec,
            "dataset": str(site / "resources_servers/example_tool_call_multireward/data/example.jsonl")}


def _write(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"copy {d}"}],
             "metadata": {"ground_truth": str(d), "crash_first": d < 2}} for d in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "markers").mkdir()
    agent = {"type": "program", "command": [sys.executable, str(AGENT), "--reward", "checksum",
                                            "--record", str(tmp_path / "calls.jsonl"),
                                            "--crash-first", str(tmp_path / "markers")]}
    verifiers = {"type": "verifiers", "pythonpath": [str(ENV_DIR)], "runner": "shared",
                 "env": {"taskset": {"id": "verifiers_add_env", "n": 4,
                                     "task": {"record": str(tmp_path / "episodes.jsonl"), "shared_tool": True}},
                         "agent": {"harness": {"id": "null"}, "max_turns": 2}}}
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": "tiny", "max_total_sequence_length": 512,
                   "generation": {"backend": "hf", "max_new_tokens": 8, "tool_parser": "hermes"}},
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 2, "max_num_steps": STEPS,
                 "val_period": 0, "val_at_start": False, "invalid_tool_call_advantage": -1.0,
                 "malformed_thinking_advantage": -1.0},
        "environments": [{"name": "toy", "kind": "toy_copy"},
                         {"name": "agent", "kind": "agent", "dataset": str(tmp_path / "rows.jsonl"),
                          "timeout_s": 120, "agent": agent},
                         {"name": "add", "kind": "agent", "timeout_s": 120, "agent": verifiers},
                         _gym_env()],
        "checkpointing": {"enabled": False}}))
    return config


def test_a_program_a_verifiers_and_a_nemo_gym_agent_train_beside_a_built_in_environment(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert cfg.policy.generation.endpoint.enabled  # turned on by the agent in the mix
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)
        groups = consumed_groups(stack.redis.url, stack.cfg)
        rollout_log = (Path(stack.cfg.run.run_dir) / "logs" / "rollout-0.log").read_text()
    agent_groups = [g for g in groups if g.env_name == "agent"]
    assert {g.env_name for g in groups} == set(ENVS)
    assert all(any(f"train/reward_mean/{env}" in r for r in rows) for env in ENVS)  # each its own metrics
    # The agent's checksum rewards differ within a group (the untrained model's toy_copy rewards are mostly all 0):
    # its groups carry nonzero advantages and the policy takes gradient steps on them.
    assert any(r["train/grad_norm"] > 0 and r["train/advantages/std"] > 0
               for r in rows if "train/reward_mean/agent" in r)
    calls = [(tuple(c["prompt"]), tuple(c["tokens"])) for c in read_rows(tmp_path / "calls.jsonl")]
    for g in agent_groups:
        assert len(g.completions) == cfg.grpo.num_generations_per_prompt
        for c in g.completions:
            full = list(g.prompt_token_ids) + list(c.token_ids)
            n = sum(c.generated_mask)
            assert n > 0 and all(c.generated_mask[-n:])  # one call: its tokens trained, the prompt not
            assert (tuple(full[:-n]), tuple(full[-n:])) in calls  # exactly what the endpoint answered the agent
    # copy 0 and copy 1 crashed their first time: their groups were handed back and ran again; the run went on.
    assert "handing it back: AgentFailed('crash" in rollout_log
    assert len(rows) >= STEPS
    tokenizer = load_tokenizer_without_torch(cfg.policy)
    _check_verifiers([g for g in groups if g.env_name == "add"], read_rows(tmp_path / "episodes.jsonl"), tokenizer)
    _check_flawed_turns(groups, [r for r in rows if "train/num_assistant_messages" in r], tokenizer, cfg)
    for g in (g for g in groups if g.env_name == "gym"):
        for c in g.completions:  # NeMo Gym's /verify's components, as GDPO would read them
            assert sum(c.generated_mask) > 0 and c.named_rewards, c


def _turns(c) -> list[tuple[list[int], int]]:
    """Each run of generated tokens of a completion (a turn): its token ids and its flaws."""
    turns, start = [], None
    for i, g in enumerate([*c.generated_mask, False]):
        if g and start is None:
            start = i
        elif not g and start is not None:
            turns.append((list(c.token_ids)[start:i], c.flaws[start] if c.flaws else 0))
            start = None
    return turns


def _check_flawed_turns(groups, rows: list[dict], tokenizer, cfg) -> None:
    """The trainer counted the turns and flawed turns of the batches replay handed it (Redis's record), and every
    turn flagged holds the markup it was flagged for."""
    turns = [t for g in groups for c in g.completions for t in _turns(c)]
    assert sum(r["train/num_assistant_messages"] for r in rows) == len(turns)
    assert sum(r["train/num_invalid_tool_calls"] for r in rows) == sum(f & 1 for _, f in turns)
    markers = cfg.policy.generation
    for ids, flaws in turns:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert not flaws & 1 or any(p in text for p in markers.invalid_tool_call_patterns), text
        assert not flaws & 2 or any(t in text for t in markers.thinking_tags), text


def _check_verifiers(groups, episodes: list[dict], tokenizer) -> None:
    """Each completion's last reply is one verifiers' client got back on that prompt, with its rubric's reward."""
    scored = {(e["a"], e["b"], e["reply"], e["reward"]) for e in episodes}
    for g in groups:
        a, b = map(int, re.search(r"what is (\d+) \+ (\d+)\?", tokenizer.decode(g.prompt_token_ids)).groups())
        for c in g.completions:
            n = sum(c.generated_mask)
            reply = tokenizer.decode(list(c.token_ids)[-n:], skip_special_tokens=True)
            assert (a, b, reply, c.reward) in scored and c.reward == rule(reply, a, b), (reply, c.reward)
