"""A fleet of two rollout workers, each with its own engine; one is killed with SIGKILL while it holds groups.

The groups it had started and never published are redelivered by the work queue (after ack_wait) to the
other worker, which generates them; every group reaches replay and the trainer exactly once. Nobody restarts
the killed worker here: this test reads the metrics itself instead of LocalStack.wait_for, whose supervisor
would. The groups in flight are read from the victim's own log ("generating" without "published").
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from recorded import recorded_batches

from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.local import LocalStack, read_metrics

STEPS = 12
KILL_AT_STEP = 3


def in_flight(log: Path) -> set[str]:
    text = log.read_text() if log.exists() else ""
    started = set(re.findall(r"group (\S+): generating", text))
    return started - set(re.findall(r"group (\S+): published", text))


def wait_until(condition, what: str, timeout_s: float, stack: LocalStack):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what}\n{stack.children.tail('trainer')}")


@pytest.mark.slow
def test_a_worker_killed_mid_group_has_its_groups_regenerated_by_the_other_and_each_reaches_replay_once(tmp_path):
    # hf only: with two vLLM workers "the victim holding a group" timed out in a fresh-clone CI run (it passed once
    # under load; the cause is not established). vLLM's worker is killed in test_chaos.py's vLLM run instead.
    cfg = load_config(None, ["rollout.num_workers=2", f"grpo.max_num_steps={STEPS}", "checkpointing.enabled=false",
                             "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
                             "rollout.max_groups_in_flight=4", "policy.generation.max_new_tokens=16"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        victim, survivor = stack.children.procs["rollout-1"], stack.children.procs["rollout-0"]
        wait_until(lambda: len(read_metrics(tmp_path)) >= KILL_AT_STEP, f"{KILL_AT_STEP} steps", 600, stack)
        log = tmp_path / "logs" / "rollout-1.log"
        wait_until(lambda: in_flight(log), "the victim holding a group", 120, stack)
        killed_ns = time.time_ns()
        victim.kill()  # SIGKILL, mid-group
        victim.wait(timeout=10)
        lost = in_flight(log)
        rows = wait_until(lambda: len(read_metrics(tmp_path)) >= STEPS and read_metrics(tmp_path),
                          f"{STEPS} steps after the kill", 900, stack)
        assert survivor.poll() is None
        got = asyncio.run(recorded_batches(stack, STEPS))

    assert lost, "the victim held no group when it was killed"
    assert len(rows) >= STEPS
    g = cfg.grpo
    seen: dict[str, types_pb2.TrajectoryGroup] = {}
    for batch in got:
        assert batch.ready and len(batch.groups) == g.num_prompts_per_step
        for group in batch.groups:
            assert group.group_id not in seen, f"group {group.group_id} reached the trainer twice"
            seen[group.group_id] = group
    # The victim may have published a group and died before logging it: replay then keeps the victim's copy
    # (finished before the kill) and drops the survivor's regenerated one (same group id).
    authors = {f"-{victim.pid}": "victim", f"-{survivor.pid}": "survivor"}
    by = {}
    for group_id in lost:
        assert group_id in seen, f"the killed worker's group {group_id} never reached replay"
        group = seen[group_id]
        by[group_id] = next((who for suffix, who in authors.items() if group.worker_id.endswith(suffix)),
                            group.worker_id)
        if by[group_id] == "victim":
            assert group.finished_at_unix_ns < killed_ns, f"{group_id} attributed to the dead worker after its death"
    assert set(by.values()) <= {"victim", "survivor"}, by
    assert "survivor" in by.values(), f"no group of the killed worker was regenerated: {by}"
