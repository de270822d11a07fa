"""`flywheel collect` on a `verifiers` environment (verifiers_add_env.py, written with the real package, its `add`
MCP tool offered on every call): with no dataset, the prompts are the taskset's rows, which the environment service
lists by running the env in the verifiers venv, and every episode runs there against rollout's endpoint, as in
training (test_verifiers_e2e.py). The model is that test's briefly supervised start, right on about half its
answers, so the rewards differ. The oracles are outside Flywheel: verifiers' own record of each episode (the
rubric appends the reply its client got back and the reward it gave), the reward rule written again, and NeMo
Gym's model and aggregation of the written rollouts.jsonl (.venv-gym)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gym_schema import nemo_gym_reads
from needs import require

from services.common.jsonl import read_rows
from services.environment.agents.verifiers_agent import DEFAULT_PYTHON
from verifiers_add import ENV_DIR, SEQ, ask, rule, supervised_start

require(DEFAULT_PYTHON.exists(), "no .venv-verifiers: run `make verifiers`")
TASKS, N = 2, 3


def test_collect_on_a_verifiers_environment_writes_the_episodes_its_rubric_scored(tmp_path):
    record = tmp_path / "episodes.jsonl"
    agent = {"type": "verifiers", "pythonpath": [str(ENV_DIR)], "runner": "shared",
             "env": {"taskset": {"id": "verifiers_add_env", "n": TASKS,
                                 "task": {"record": str(record), "shared_tool": True}},
                     "agent": {"harness": {"id": "null"}, "max_turns": 2}}}
    config = tmp_path / "verifiers.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": str(supervised_start(tmp_path / "model", TASKS)), "max_total_sequence_length": SEQ,
                   "generation": {"backend": "hf", "max_new_tokens": 8, "tool_parser": "hermes"}},
        "grpo": {"max_val_samples": TASKS},
        "environments": [{"name": "add", "kind": "agent", "timeout_s": 120, "agent": agent}]}))
    out = tmp_path / "rollouts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "collect", "--config", str(config), "--n", str(N),
                           "--out", str(out), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    episodes = read_rows(record)
    assert len(lines) == len(episodes) == TASKS * N and {line["env_name"] for line in lines} == {"add"}
    assert nemo_gym_reads(out) == (TASKS * N, pytest.approx(sum(line["reward"] for line in lines) / len(lines)))
    asked = {ask(e["a"]): (e["a"], e["b"]) for e in episodes}
    assert len(asked) == TASKS  # the taskset's rows, each collected N times
    scored = sorted((e["reply"], e["reward"]) for e in episodes)
    written = []
    for line in lines:
        prompt = line["responses_create_params"]["input"]
        a, b = asked[prompt[-1]["content"]]
        messages = [item for item in line["response"]["output"] if item["type"] == "message"]
        reply = "".join(part["text"] for part in messages[-1]["content"]) if messages else ""
        assert line["reply_chars"] == len(reply)  # the verifiers metric of the reply the line shows
        assert line["reward"] == rule(reply, a, b)
        written.append((reply, line["reward"]))
    assert sorted(written) == scored, (written, scored)  # each line is an episode as verifiers' rubric saw it
