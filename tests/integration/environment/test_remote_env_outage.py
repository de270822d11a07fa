"""Full stack: a remote environment that goes down mid-run trains nothing it did not score, and removing it lets
the run go on without it.

A run mixes the built-in toy environment with examples/remote_env_server.py, submitted at run time. The remote is
SIGKILLed while the run trains on both, and started again on the same port once rollout has handed groups back.
Meanwhile the environment service answers the remote's Steps UNAVAILABLE and rollout hands those groups back to the
work queue (the run waits for them: their steps are short of groups). Every trained episode of the remote must
carry the remote's own verdict: the server sets `answer` to the first character of the response, which no failed or
made-up result would have. A dead remote that is removed (`flywheel env remove`) instead has its leased groups
replaced by prompts of the remaining mix at their next delivery, not after the removal's 10-minute grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from env_harness import start_example_server
from recorded import recorded_batches

from services.common.config import load_config
from services.common.infra import free_port
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2
from services.controller.client import ControllerClient
from services.local import LocalStack, read_metrics

NAME = "first_char"
KEY = f"train/reward_mean/{NAME}"
pytestmark = pytest.mark.slow


def rows(count: int) -> list[types_pb2.DatasetRow]:
    out = []
    for i in range(count):
        row = types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content=f"copy {i % 5}")])
        row.metadata.update({"ground_truth": str(i % 5)})
        out.append(row)
    return out


async def on_controller(stack: LocalStack, call: Callable[[ControllerClient], Awaitable]) -> None:
    client = ControllerClient(stack.cfg.addresses.controller, timeout_s=20)
    try:
        await call(client)
    finally:
        await client.close()


def submit(stack: LocalStack, address: str) -> None:
    spec = controller_pb2.EnvironmentSpec(name=NAME, address=address, rows=rows(50), weight=1, max_turns=1,
                                          timeout_seconds=2.0, sampling=types_pb2.SamplingParams(max_new_tokens=4))
    asyncio.run(on_controller(stack, lambda client: client.submit(spec)))


def small_run():
    return load_config(None, ["grpo.max_num_steps=1000", "grpo.num_prompts_per_step=4",
                              "grpo.num_generations_per_prompt=4", "grpo.async_grpo.max_trajectory_age_steps=1",
                              "checkpointing.enabled=false"])


def test_a_remote_that_goes_down_is_waited_for_and_none_of_its_failures_is_trained(tmp_path):
    cfg = small_run()
    port = free_port()
    remote, address = start_example_server(port)
    try:
        with LocalStack(cfg, tmp_path) as stack:
            stack.start_services()
            stack.wait_for(lambda r: len(r) >= 1, "the first step", timeout_s=180)
            submit(stack, address)
            stack.wait_for(lambda r: sum(KEY in x for x in r) >= 2, f"{NAME} trained", timeout_s=120)

            remote.kill()  # SIGKILL: no goodbye to the environment service
            remote.wait()
            rollout_log = tmp_path / "logs" / "rollout-0.log"
            stack.wait_for(lambda r: rollout_log.read_text().count("handing it back") >= 3,
                           "rollout handing the remote's groups back", 60)
            remote, _ = start_example_server(port)
            back = len(read_metrics(tmp_path))
            trained = stack.wait_for(lambda r: sum(KEY in x for x in r[back:]) >= 2, f"{NAME} trained again", 120)
            steps = len(trained)
            got = asyncio.run(recorded_batches(stack, steps))
    finally:
        if remote.poll() is None:
            remote.kill()
        remote.wait()

    assert f"remote environment {NAME} at" in (tmp_path / "logs" / "environment.log").read_text()
    assert "UNAVAILABLE" in (tmp_path / "logs" / "rollout-0.log").read_text()
    remote_groups = [g for batch in got for g in batch.groups if g.env_name == NAME]
    assert len(remote_groups) >= 4
    for group in remote_groups:
        for c in group.completions:
            # the remote's answer is the response's first non-blank character: a result it never gave has none
            assert c.answer == c.text.strip()[:1], (group.group_id, c.text, c.answer, c.reward)


def test_removing_a_dead_remote_replaces_its_leased_groups_and_the_run_goes_on(tmp_path):
    remote, address = start_example_server()
    try:
        with LocalStack(small_run(), tmp_path) as stack:
            stack.start_services()
            stack.wait_for(lambda r: len(r) >= 1, "the first step", timeout_s=180)
            submit(stack, address)
            stack.wait_for(lambda r: sum(KEY in x for x in r) >= 2, f"{NAME} trained", timeout_s=120)

            remote.kill()
            remote.wait()
            rollout_log = tmp_path / "logs" / "rollout-0.log"
            stack.wait_for(lambda r: rollout_log.read_text().count("handing it back") >= 3,
                           "rollout handing the remote's groups back", 60)
            asyncio.run(on_controller(stack, lambda client: client.remove(NAME)))
            # The dead remote's groups were leased for the next steps: those steps go on only once each group is
            # replaced (at its next delivery, at most 10 s later), well before the 10-minute grace.
            removed = len(read_metrics(tmp_path))
            stack.wait_for(lambda r: len(r) >= removed + 5, "five steps after the removal", 90)
    finally:
        if remote.poll() is None:
            remote.kill()
        remote.wait()

    assert "the controller replaces it" in rollout_log.read_text()
