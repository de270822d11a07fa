"""A `verifiers` environment with a tool trains through `flywheel up` and its reward rises: verifiers_add_env.py
(written with the real package, an `add` MCP tool and a rubric rewarding the right sum) is an environment of the
config's mix with no dataset; the controller leases the taskset's rows, which the environment service lists by
running the env in the verifiers venv (Prompts), and each episode runs in that venv through VerifiersAgent against
the rollout worker's endpoint. The agent uses the shared runner (one verifiers process for every episode, the
tool served once for the taskset), or a run of a few dozen episodes would not fit a few minutes on 2 cores.

The run starts from a briefly supervised model (tests/tool_demos.py, on the prompt as the endpoint renders it with
the tool verifiers offers): half its demonstrations answer the sum, half the first operand, so it starts right on
about half its episodes and GRPO has to learn which answer the rubric pays for. The tiny model answers at once: it
is offered the tool on every call but does not call it (a supervised start that writes verifiers' 84-character
<tool_call> well takes longer than this test may: after 400 steps most sampled calls were still garbled).

The oracle is verifiers' own side of each episode: the env's rubric appends the reply its client got back from the
model and the reward it gave (the taskset's `record`). Every completion of the batches the trainer consumed
(replay's chosen groups in Redis, by step) must end with one of those replies, on its task's prompt, and carry the
reward the rule gives that reply (the last number equals a + b), checked here independently; the rise is measured
on those rewards, first steps against last.

Needs `.venv-verifiers` (`make verifiers`). Each episode still starts verifiers' chat program (a Python with the
openai and mcp packages), so the run is small: STEPS steps of the 4 tasks x 4 episodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from needs import require
from oracles import consumed_steps
from services.common.config import load_config
from services.common.jsonl import read_rows
from services.common.tokenizing import load_tokenizer_without_torch
from services.environment.agents.verifiers_agent import DEFAULT_PYTHON
from services.local import LocalStack
from services.rollout.episodes import prompt_token_ids
from verifiers_add import ENV_DIR, SEQ, TOOL, ask, rule, supervised_start

pytestmark = pytest.mark.slow
require(DEFAULT_PYTHON.exists(), "no .venv-verifiers: run `make verifiers`")
TASKS = 4
STEPS = 8
LR = "3e-3"
PROMPT = re.compile(r"what is (\d+) \+ (\d+)\? use the add tool\.")
RISE = 1 / 16
LEVEL = 0.75
"""The second half's mean reward (the last STEPS/2 steps, 64 episodes) must be at least LEVEL, and RISE over step 0's
(the supervised start's own 16 episodes: with max_trajectory_age_steps 0, step 0 trains on version 0's groups,
before any update): one episode in 16 more. LEVEL is what tells learning from none (runs with learning off stayed at
0.48-0.72, every run that learned reached 0.77-0.94, figures below); RISE was 0.15 until a run under two suites at
once (2026-11-27) learned and failed it from a lucky start, [0.75, 0.69, 0.81, 0.81, 0.81, 0.88, 0.75, 0.81] 0.75 ->
0.81 (step 0's mean spreads by about 0.12). Step 0, not the first half: learning can be done within a step or two,
and a fresh-clone CI run [0.44, 0.88, 0.69, 0.81, 0.81, 0.75, 0.81, 0.88] (2026-11-27) failed the halves bar (0.70
-> 0.81) having risen from 0.44 at once. The second half, not the last step or two: a step is 16 episodes, whose
mean spreads by about 0.12, and an earlier CI run [0.31, 0.62, 0.75, 0.81, 0.88, 0.81, 0.94, 0.62] ended on a low
step. Measured on 2 shared cores (2026-11-26/27), per step: 8 steps at lr 3e-3 [0.69, 0.56, 0.62, 0.69, 0.88, 1.0,
0.88, 1.0] 0.69 -> 0.94, [0.62, 0.62, 0.81, 0.81, 0.94, 0.94, 0.94, 0.88] 0.62 -> 0.93, and the two CI runs above
0.31 -> 0.81 and 0.44 -> 0.81; at lr 2e-3 [0.69, 0.69, 0.81, 0.94, 0.88, 1.0, 1.0, 0.81] 0.69 -> 0.92 and [0.69,
0.69, 0.81, 0.81, 0.81, 0.69, 0.75, 0.81] 0.69 -> 0.77 (failing the old RISE). With learning off (lr 1e-12): 8 steps
[0.75, 0.62, 0.81, 0.69, 0.62, 0.62, 0.50, 0.44] 0.75 -> 0.55 and 6 steps [0.50, 0.44, 0.50, 0.44, 0.62, 0.38] 0.50
-> 0.48, both failing. Step 0's mean spreads by about 0.12 (16 episodes at p = 0.6), so RISE alone is a weak bar; a
run that does not learn also has to end at LEVEL, above the 0.48-0.72 such runs stayed at. From a 100-step start
with 2 tasks x 4 a step, lr 1e-3 stayed flat over 8 steps and lr 5e-3 lost the answer's EOS (replies of digit
strings, reward near 0); a start right on a quarter of its demonstrations rose too slowly (0.31 -> 0.59 over 8
steps)."""


def _write(tmp_path: Path, model: Path) -> Path:
    agent = {"type": "verifiers", "pythonpath": [str(ENV_DIR)], "runner": "shared",
             "env": {"taskset": {"id": "verifiers_add_env", "n": TASKS,
                                 "task": {"record": str(tmp_path / "episodes.jsonl"), "shared_tool": True}},
                     "agent": {"harness": {"id": "null"}, "max_turns": 2}}}
    config = tmp_path / "verifiers.yaml"
    config.write_text(json.dumps({
        "policy": {"model_name": str(model), "max_total_sequence_length": SEQ,
                   "generation": {"backend": "hf", "max_new_tokens": 8, "tool_parser": "hermes"},
                   "optimizer": {"kwargs": {"lr": float(LR)}}},
        "loss_fn": {"reference_policy_kl_penalty": 0.0},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": STEPS,
                 "val_period": 0, "val_at_start": False, "async_grpo": {"max_trajectory_age_steps": 0}},
        "environments": [{"name": "add", "kind": "agent", "timeout_s": 240, "agent": agent}],
        "checkpointing": {"enabled": False}}))
    return config


def _last_reply(tokenizer, completion) -> str:
    """The completion's last run of generated tokens: the episode's final assistant message."""
    pairs = list(zip(completion.token_ids, completion.generated_mask))
    start = max(i for i, (_, m) in enumerate(pairs) if not m) + 1 if not all(m for _, m in pairs) else 0
    return tokenizer.decode([t for t, _ in pairs[start:]], skip_special_tokens=True)


def test_a_verifiers_environment_with_a_tool_trains_through_flywheel_up_and_its_reward_rises(tmp_path):
    cfg = load_config(_write(tmp_path, supervised_start(tmp_path / "model", TASKS)))
    assert cfg.policy.generation.endpoint.enabled  # turned on by the agent in the mix
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)
        steps = consumed_steps(stack.redis.url, stack.cfg)
    assert all("train/reward_mean/add" in r for r in rows)
    assert len(steps) >= STEPS and all(len(gs) == cfg.grpo.num_prompts_per_step for gs in steps.values())
    tokenizer = load_tokenizer_without_torch(cfg.policy)
    episodes = [(e["a"], e["b"], e["reply"], e["reward"]) for e in read_rows(tmp_path / "episodes.jsonl")]
    seen_tasks, rewards = set(), {}
    for step, groups in steps.items():
        for g in groups:
            assert g.env_name == "add" and len(g.completions) == cfg.grpo.num_generations_per_prompt
            a, b = map(int, PROMPT.search(tokenizer.decode(g.prompt_token_ids)).groups())  # a taskset row's prompt
            seen_tasks.add((a, b))
            # the prompt the supervised start was trained on: the task with the tool verifiers offered
            asked = [{"role": "user", "content": ask(a)}]
            assert list(g.prompt_token_ids) == prompt_token_ids(tokenizer, asked, [TOOL])
            for c in g.completions:
                reply = _last_reply(tokenizer, c)
                assert (a, b, reply, c.reward) in episodes  # the reply verifiers got back, scored by its rubric
                assert c.reward == rule(reply, a, b)
                rewards.setdefault(step, []).append(c.reward)
    assert len(seen_tasks) >= 2  # the controller walked the taskset, not one row
    by_step = [rewards[step] for step in sorted(rewards)]
    print("rubric reward per step:", [round(sum(r) / len(r), 3) for r in by_step])
    assert min(rewards) == 0  # the supervised start's own episodes are the baseline
    start, last = by_step[0], sum(by_step[-(STEPS // 2):], [])
    start, last = sum(start) / len(start), sum(last) / len(last)
    assert last >= start + RISE and last >= LEVEL, f"no rise: step 0 {start:.3f}, second half {last:.3f}"
