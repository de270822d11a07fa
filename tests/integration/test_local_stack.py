"""The walking skeleton end to end: real NATS, Redis, gRPC, and each service in its own process."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_config
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc
from services.local import LocalStack

STEPS = 50


async def _batches(address: str, steps: int, per_step: int, k: int) -> list[replay_pb2.SampleResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = replay_pb2_grpc.ReplayServiceStub(channel)
        return [await stub.Sample(replay_pb2.SampleRequest(step=s, prompts_per_step=per_step, max_staleness=k))
                for s in range(steps)]


@pytest.mark.slow
def test_services_learn_toy_task_with_version_tags_and_no_group_used_twice(tmp_path):
    cfg = load_config(None, [f"grpo.max_num_steps={STEPS}", "grpo.max_staleness=1"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
        g = stack.cfg.grpo
        batches = asyncio.run(_batches(stack.cfg.addresses.replay, STEPS, g.num_prompts_per_step, g.max_staleness))

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
            assert proc.poll() is None, f"{name} exited early:\n{stack.children.tail(name)}"
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=5)  # raises TimeoutExpired if the service does not stop in time
            assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{stack.children.tail(name)}"
