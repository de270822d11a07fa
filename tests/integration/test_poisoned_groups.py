"""Groups that fail the same way on every delivery are poisoned, shown and counted; the run goes on past a few
of them and stops, naming the error, past rollout.max_poisoned_groups.

The failure is a real one: the tiny model's chat template behind Gemma's check, which refuses a conversation
that opens with a system message (`raise_exception('System role not supported')`), and a dataset in which some
rows, or all, open with one. The console is `flywheel up`'s (services.local._follow), the count rollout's own
/metrics, and what was trained replay's record of each step's batch.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
from recorded import recorded_batches

from services.common.config import load_config
from services.common.modeling import TINY_CHAT_TEMPLATE
from services.local import LocalStack, _follow, read_metrics, read_restarts

pytestmark = pytest.mark.slow
STEPS = 3
ROWS = 16
GEMMA_CHECK = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
LINE = re.compile(r"poisoned: prompt toy_copy/e(\d+)/(\d+) \(toy_copy\) failed on delivery (\d+) and was dropped "
                  r"\(rollout.max_group_failures\): TemplateError: System role not supported")


def write_config(tmp_path: Path, bad: set[int], max_poisoned: int) -> Path:
    rows = []
    for i in range(ROWS):
        messages = [{"role": "system", "content": "answer with one digit"}] if i in bad else []
        messages += [{"role": "user", "content": f"copy {i % 5}"}, {"role": "assistant", "content": str(i % 5)}]
        rows.append({"messages": messages})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "gemma_like.jinja").write_text(GEMMA_CHECK + TINY_CHAT_TEMPLATE)
    config = tmp_path / "config.yaml"
    # Every good row is one group of the 3 steps (4 prompts each): a poisoned row's replacement is the epoch's next
    # row, so the first epoch is leased exactly, each bad row in it once. A second epoch is allowed, unused.
    config.write_text(f"""policy:
  model_name: tiny
  tokenizer: {{chat_template: {tmp_path / 'gemma_like.jinja'}}}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 4, max_num_steps: {STEPS}, max_num_epochs: 2,
        async_grpo: {{enabled: true, max_trajectory_age_steps: 1}}}}
data: {{train: {{data_path: {tmp_path / 'rows.jsonl'}, env_name: toy_copy}}}}
rollout: {{max_group_failures: 3, max_poisoned_groups: {max_poisoned}}}
checkpointing: {{enabled: false}}
""")
    return config


def follow(stack: LocalStack) -> int:
    """`flywheel up`'s console loop; a build that spins forever fails here instead of hanging the suite."""
    return asyncio.run(asyncio.wait_for(_follow(stack.cfg, stack.children), 300))


def poisoned_total(stack: LocalStack) -> float:
    port = stack.children.metrics_ports["rollout-0"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    [value] = re.findall(r"^flywheel_rollout_poisoned_groups_total (\S+)$", body, re.MULTILINE)
    return float(value)


def test_groups_that_always_fail_are_poisoned_shown_counted_and_the_run_trains_on_the_rest(tmp_path, capsys):
    bad = {1, 6, 9, 14}
    cfg = load_config(write_config(tmp_path, bad, max_poisoned=10))
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        code = follow(stack)
        counted = poisoned_total(stack)
        batches = asyncio.run(recorded_batches(stack, STEPS))
    console = capsys.readouterr().err
    lines = LINE.findall(console)
    assert code == 0 and len(read_metrics(tmp_path / "run")) == STEPS, console[-3000:]
    assert {int(row) for _, row, _ in lines} == bad and len(lines) == len(bad), console[-3000:]
    assert all(epoch == "0" and int(delivery) >= 3 for epoch, _, delivery in lines), lines
    assert counted == len(bad)
    trained = {g.prompt_id for b in batches for g in b.groups}
    assert len(trained) == STEPS * 4 and not {f"toy_copy/e0/{i}" for i in bad} & trained, trained


def test_a_run_whose_every_group_fails_stops_naming_the_error(tmp_path, capsys):
    cfg = load_config(write_config(tmp_path, set(range(ROWS)), max_poisoned=2))
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        code = follow(stack)
    console = capsys.readouterr().err
    assert code == 1 and len(LINE.findall(console)) >= 3, console[-3000:]
    assert "controller stopped the run (exit 78)" in console, console[-3000:]
    assert re.search(r"the run cannot go on: 3 prompt groups were poisoned .* more than rollout.max_poisoned_groups=2; "
                     r"the last, prompt 'toy_copy/e0/\d+', failed with: TemplateError: System role not supported",
                     console), console[-3000:]
    assert read_metrics(tmp_path / "run") == [] and read_restarts(tmp_path / "run") == []
