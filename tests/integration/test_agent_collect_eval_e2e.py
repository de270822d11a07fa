"""`flywheel collect`, `flywheel eval` and a training run's validation on a program agent environment
(tests/fixtures/agents/copy_agent.py, the real `openai` SDK), its episodes run against rollout's endpoint as
training runs them. The oracles are outside the code under test: the agent's own scoring rule (sum(ord(c)) % 97
of its last answer, `--reward checksum`) applied again to what the rollout line says the model answered, NeMo
Gym's own model and aggregation of rollouts.jsonl (.venv-gym), and for eval and validation the agent's own log
of the replies the endpoint sent it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gym_schema import nemo_gym_reads

from services.common.config import load_config
from services.common.data.from_gym import read_rollouts
from services.common.jsonl import read_rows
from services.local import LocalStack

AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "copy_agent.py"
PROMPTS, N = 2, 2


def _rows(path: Path, digits, **metadata) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"copy {d}"}], "metadata": {"ground_truth": str(d), **metadata}}
            for d in digits]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, *agent_args: str, crash_first: bool = False, **extra) -> Path:
    """The agent environment trains on copy 0..PROMPTS-1 and validates on copy 7.. (its prompts tell them apart).
    `crash_first`: each validation task's first episode crashes (the agent's `--crash-first`)."""
    train = _rows(tmp_path / "rows.jsonl", range(PROMPTS))
    validation = _rows(tmp_path / "val.jsonl", range(7, 7 + PROMPTS), **({"crash_first": True} if crash_first else {}))
    agent = {"type": "program", "command": [sys.executable, str(AGENT), "--reward", "checksum", *agent_args]}
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": "tiny", "max_total_sequence_length": 256,
                   "generation": {"backend": "hf", "max_new_tokens": 8, "tool_parser": "hermes"}},
        "data": {"validation": {"data_path": str(validation), "env_name": "agent"}},
        "environments": [{"name": "agent", "kind": "agent", "dataset": str(train), "timeout_s": 60, "agent": agent}],
        **extra}))
    return config


def _flywheel(*args: str) -> None:
    """Runs the CLI, which must succeed."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _checksum(text: str) -> float:
    return float(sum(map(ord, text)) % 97)


def _last_answer(output: list[dict]) -> str:
    """The text of the episode's last model reply: the output items after the last tool result or user turn."""
    last = max((i for i, item in enumerate(output) if item["type"] == "function_call_output"
                or item.get("role") == "user"), default=-1)
    return "".join(part["text"] for item in output[last + 1:] if item["type"] == "message"
                   for part in item["content"])


def test_collect_on_a_program_agent_writes_its_recorded_episodes_with_the_agents_rewards(tmp_path):
    """The agent calls its own lookup tool first, then asks the model twice: each line's output is that whole
    conversation as Responses items, and its reward and metric are what the agent scores the last reply. Each
    task's first episode crashes: rollout runs it again, so every line is still there."""
    out, markers = tmp_path / "rollouts.jsonl", tmp_path / "crashed"
    markers.mkdir()
    config = _config(tmp_path, "--lookup", "--calls", "2", "--crash-first", str(markers), crash_first=True)
    _flywheel("collect", "--config", str(config), "--n", str(N), "--out", str(out), "--run-dir", str(tmp_path / "run"))
    assert sorted(p.name for p in markers.iterdir()) == ["copy_7", "copy_8"]  # each task did crash once
    assert (tmp_path / "run" / "collect_failed.jsonl").read_text() == ""
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == PROMPTS * N and {line["env_name"] for line in lines} == {"agent"}
    assert nemo_gym_reads(out) == (PROMPTS * N, pytest.approx(sum(line["reward"] for line in lines) / len(lines)))
    rollouts, drops = read_rollouts(out)
    assert drops == [] and len(rollouts) == PROMPTS * N
    for line in lines:
        output = line["response"]["output"]
        call, result = output[:2]
        assert call["type"] == "function_call" and call["name"] == "lookup"
        assert result == {"type": "function_call_output", "call_id": call["call_id"],
                          "output": f"answer with {7 + line['_ng_task_index']}"}
        assert output[2]["type"] == "message" and output[2]["role"] == "assistant"
        assert {"type": "message", "role": "user", "content": "again"} in output[3:]
        answer = _last_answer(output)
        assert line["reward"] == _checksum(answer) and line["answer_chars"] == len(answer), line
    assert len({line["reward"] for line in lines}) > 1  # the rewards are the episodes' own, not one constant


def test_eval_on_a_program_agent_reports_the_mean_of_the_rewards_the_agent_gave(tmp_path):
    """The agent always crashes on copy 8, after its model call: that prompt is tried 3 times
    (rollout.max_group_failures), then left out of the metrics and counted, its error kept; copy 7 is scored."""
    record = tmp_path / "calls.jsonl"
    run_dir = tmp_path / "run"
    config = _config(tmp_path, "--record", str(record), "--fault", "crash", "--fault-task", "copy 8")
    _flywheel("eval", "--config", str(config), "--n", str(N), "--run-dir", str(run_dir))
    rows = read_rows(record)  # one call an episode
    scored = [row for row in rows if row["task"] == "copy 7"]
    replies = [row["text"] or "" for row in scored]
    metrics = json.loads((run_dir / "eval.json").read_text())
    assert len(replies) == N and metrics["validation/num_prompts"] == 1 and metrics["validation/failed_prompts"] == 1
    assert metrics["validation/accuracy"] == pytest.approx(sum(map(_checksum, replies)) / len(replies))
    assert metrics["validation/avg_length"] == pytest.approx(sum(len(row["tokens"]) for row in scored) / N)
    assert sum(row["task"] == "copy 8" for row in rows) >= 3  # an episode of it ran all its attempts
    failed = [line for line in read_rows(run_dir / "eval_samples.jsonl") if "error" in line]
    assert [line["prompt"] for line in failed] == ["copy 8"] and "crash" in failed[0]["error"], failed


def test_a_training_runs_validation_on_a_program_agent_reports_the_rewards_the_agent_gave(tmp_path):
    """Validation at start (version 0) on the validation prompts' agent episodes, while the agent also trains on
    the training prompts; the run ends there."""
    record = tmp_path / "calls.jsonl"
    grpo = {"num_prompts_per_step": PROMPTS, "num_generations_per_prompt": N, "max_num_steps": 1, "val_period": 0,
            "val_at_start": True, "val_at_end": False, "val_num_generations_per_prompt": N}
    cfg = load_config(_config(tmp_path, "--record", str(record), grpo=grpo, checkpointing={"enabled": False}))
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        written = Path(stack.cfg.run.run_dir) / "validation.jsonl"  # the controller's record of each validation
        stack.wait_for(lambda _: written.exists() and written.read_text().strip(), "a validation", timeout_s=120)
    [metrics] = read_rows(written)
    mine = [row for row in read_rows(record) if row["task"] not in ("copy 0", "copy 1")]  # validation's calls
    assert {row["task"] for row in mine} == {"copy 7", "copy 8"} and len(mine) == PROMPTS * N
    assert metrics["validation/policy_version"] == 0 and metrics["validation/num_prompts"] == PROMPTS
    rewards = [_checksum(r["text"] or "") for r in mine]
    assert metrics["validation/accuracy"] == pytest.approx(sum(rewards) / len(rewards))
    assert metrics["validation/avg_length"] == pytest.approx(sum(len(r["tokens"]) for r in mine) / len(mine))
