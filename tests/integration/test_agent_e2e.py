"""A program agent trains through `flywheel up`, mixed with a built-in environment: tests/fixtures/agents/
copy_agent.py (the real `openai` SDK) answers toy copy prompts through each rollout worker's endpoint and scores
them with a checksum of its answer (a reward that differs within a group from the first step on), and the
steps' batches hold its groups next to toy_copy's. The oracle is the agent's own log of the token ids the endpoint
answered it with, against the batches the trainer consumed (replay's chosen groups in Redis). Some prompts make
their first episode crash: their groups fail, are handed back and run again, and the run goes on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from oracles import consumed_groups
from services.common.config import load_config
from services.common.jsonl import read_rows
from services.local import LocalStack

pytestmark = pytest.mark.slow
AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agents" / "copy_agent.py"
STEPS = 3


def _write(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"copy {d}"}],
             "metadata": {"ground_truth": str(d), "crash_first": d < 2}} for d in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "markers").mkdir()
    agent = {"type": "program", "command": [sys.executable, str(AGENT), "--reward", "checksum",
                                            "--record", str(tmp_path / "calls.jsonl"),
                                            "--crash-first", str(tmp_path / "markers")]}
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": "tiny", "generation": {"backend": "hf"}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": STEPS,
                 "val_period": 0, "val_at_start": False},
        "environments": [{"name": "toy", "kind": "toy_copy"},
                         {"name": "agent", "kind": "agent", "dataset": str(tmp_path / "rows.jsonl"),
                          "timeout_s": 120, "agent": agent}],
        "checkpointing": {"enabled": False}}))
    return config


def test_a_program_agent_trains_beside_a_built_in_environment(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert cfg.policy.generation.endpoint.enabled  # turned on by the agent in the mix
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)
        groups = consumed_groups(stack.redis.url, stack.cfg)
        rollout_log = (Path(stack.cfg.run.run_dir) / "logs" / "rollout-0.log").read_text()
    agent_groups = [g for g in groups if g.env_name == "agent"]
    assert agent_groups and any(g.env_name == "toy" for g in groups)
    assert any("train/reward_mean/agent" in r for r in rows) and any("train/reward_mean/toy" in r for r in rows)
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
