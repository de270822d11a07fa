"""The walking skeleton end to end: real NATS, Redis, gRPC, and each service in its own process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from processes import processes_mentioning
from recorded import recorded_batches
from services.common.config import load_config
from services.local import INFRA, LocalStack, read_metrics

STEPS = 50


@pytest.mark.slow
def test_services_learn_toy_task_with_version_tags_and_no_group_used_twice(tmp_path):
    # No checkpoints: the ledger below reads every step's batch back, and a committed checkpoint frees them.
    cfg = load_config(None, [f"grpo.max_num_steps={STEPS}", "grpo.async_grpo.max_trajectory_age_steps=1",
                             "checkpointing.enabled=false"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
        batches = asyncio.run(recorded_batches(stack, STEPS))
        g = stack.cfg.grpo

    first = sum(r["train/reward_mean"] for r in rows[:10]) / 10
    last = sum(r["train/reward_mean"] for r in rows[-10:]) / 10
    assert last >= 0.15 and last >= 2 * first, f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"

    seen: set[str] = set()
    for step, batch in enumerate(batches):
        assert batch.ready and len(batch.groups) == g.num_prompts_per_step
        for group in batch.groups:
            assert group.group_id not in seen, f"group {group.group_id} used twice"
            seen.add(group.group_id)
            assert len(group.completions) == g.num_generations_per_prompt
            for c in group.completions:
                assert 0 <= c.version_start <= c.version_end
                assert step - c.version_start <= g.max_staleness


def test_every_service_answers_health_checks_serves_metrics_and_stops_on_sigterm_within_5s(tmp_path):
    with LocalStack(load_config(), tmp_path) as stack:
        stack.start_services()
        a = stack.cfg.addresses
        addresses = {"controller": a.controller, "environment": a.environment, "replay": a.replay,
                     "trainer": a.trainer, "rollout-0": a.rollout}
        for name, address in addresses.items():
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=120, wait_for_ready=True)
                except grpc.RpcError as err:
                    raise AssertionError(f"{name} health check failed: {err}\n{stack.children.tail(name)}") from None
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            port = stack.children.metrics_ports[name]
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert "flywheel_" in body, f"{name} exports no flywheel_ metrics"
        for name, proc in stack.children.procs.items():
            if name in INFRA:
                continue
            assert proc.poll() is None, f"{name} exited early:\n{stack.children.tail(name)}"
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=5)  # raises TimeoutExpired if the service does not stop in time
            assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{stack.children.tail(name)}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_flywheel_up_stopped_by_a_signal_leaves_no_process_behind(tmp_path, sig):
    """Ctrl-C and SIGTERM stop the run through its cleanup; even SIGKILL, which skips it, orphans nothing
    (every child dies with the launcher)."""
    run_dir = tmp_path / "run"
    # Started as a shell starts a background job, with SIGINT ignored (a script's `&`, nohup): it must stop anyway.
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir),
                           "grpo.max_num_steps=1000"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 300
    while len(read_metrics(run_dir)) < 2:  # every service up and training
        assert up.poll() is None and time.monotonic() < deadline, "flywheel up did not start training"
        time.sleep(0.5)
    assert len(processes_mentioning(str(run_dir))) >= 7, "NATS, Redis and five services"
    up.send_signal(sig)
    code = up.wait(timeout=60)
    deadline = time.monotonic() + 15  # SIGKILL'd children are reaped by init, not at once
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(run_dir)), "a process outlived flywheel up"
    assert code == {signal.SIGINT: 130, signal.SIGTERM: 130, signal.SIGKILL: -9}[sig]

