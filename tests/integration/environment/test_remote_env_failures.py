"""A remote environment that crashes, hangs or answers garbage fails the call with UNAVAILABLE (rollout hands the
group back): no episode is scored from a call that gave no usable answer, and the service goes on."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from env_harness import start_example_server, step_request
from environment_service import serve_environment
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common.errors import InvalidArgument, Unavailable
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc
from services.environment.remote import RemoteEnvironment


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter


def failed_calls(env: str, reason: str) -> float:
    return REGISTRY.get_sample_value("flywheel_remote_env_failures_total", {"env": env, "reason": reason}) or 0


def remote(name: str, address: str, tracer, **kw) -> RemoteEnvironment:
    kw = {"timeout_s": 0.5, "retries": 1, "backoff_s": 0.05, **kw}
    return RemoteEnvironment(name, address, tracer=tracer, **kw)


async def test_healthy_remote_scores_episodes(example_remote, spans):
    _, address = example_remote
    env = remote("healthy", address, spans[0])
    results = await env.step(step_request("healthy", 3))
    assert [r.reward for r in results] == [1.0, 1.0, 1.0] and not any(r.error for r in results)
    await env.close()


async def test_killed_remote_fails_the_call_with_a_counter_and_a_span_event(spans):
    tracer, exporter = spans
    proc, address = start_example_server()
    env = remote("crashing", address, tracer)
    try:
        assert (await env.step(step_request("crashing", 2)))[0].reward == 1.0
        proc.kill()
        proc.wait()
        with pytest.raises(Unavailable, match="unavailable: UNAVAILABLE"):
            await env.step(step_request("crashing", 2))
    finally:
        await env.close()
        if proc.poll() is None:
            proc.kill()
    assert failed_calls("crashing", "unavailable") == 1
    failed = exporter.get_finished_spans()[-1]
    assert failed.name == "environment.remote_step" and not failed.status.is_ok
    assert failed.events[0].name == "remote_env.failed" and failed.events[0].attributes["reason"] == "unavailable"


async def test_hanging_remote_fails_after_its_deadline_and_retries(faulty_remote, spans):
    faulty_remote.servicer.mode = "hang"
    env = remote("hanging", faulty_remote.address, spans[0], timeout_s=0.3, retries=1)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
        await env.step(step_request("hanging", 4))
    elapsed = time.monotonic() - t0
    await env.close()
    assert faulty_remote.servicer.calls == 2, "one retry after the first deadline"
    assert 0.6 <= elapsed < 2.0
    assert failed_calls("hanging", "deadline") == 1


async def test_retries_stay_inside_the_callers_budget(faulty_remote, spans):
    faulty_remote.servicer.mode = "hang"
    env = remote("budget", faulty_remote.address, spans[0], timeout_s=5.0, retries=3)
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        await env.step(step_request("budget", 1), budget_s=1.0)
    await env.close()
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("mode, reason", [("wrong_count", "bad_response"), ("error", "rpc_error")])
async def test_garbage_or_an_error_status_fails_the_whole_batch(faulty_remote, spans, mode, reason):
    faulty_remote.servicer.mode = mode
    name = f"garbage-{mode}"
    env = remote(name, faulty_remote.address, spans[0])
    with pytest.raises(Unavailable, match=reason):
        await env.step(step_request(name, 3))
    await env.close()
    assert faulty_remote.servicer.calls == 1, "garbage and error statuses are not retried"
    assert failed_calls(name, reason) == 1


async def test_a_non_finite_reward_fails_the_whole_call(faulty_remote, spans):
    faulty_remote.servicer.mode = "nan"
    env = remote("nan", faulty_remote.address, spans[0])
    with pytest.raises(Unavailable, match="2 of 2 results had a non-finite reward"):
        await env.step(step_request("nan", 2))
    await env.close()
    assert failed_calls("nan", "bad_response") == 1


async def test_breaker_opens_after_failures_in_a_row_then_a_probe_closes_it(faulty_remote, spans):
    faulty_remote.servicer.mode = "error"
    env = remote("breaker", faulty_remote.address, spans[0], breaker_failures=2, breaker_open_s=0.5)
    for _ in range(2):
        with pytest.raises(Unavailable):
            await env.step(step_request("breaker", 1))
    assert env.circuit_open and faulty_remote.servicer.calls == 2
    faulty_remote.servicer.mode = "ok"
    with pytest.raises(Unavailable, match="circuit_open"):
        await env.step(step_request("breaker", 1))
    assert faulty_remote.servicer.calls == 2, "open: the remote is not called"
    assert failed_calls("breaker", "circuit_open") == 1
    await asyncio.sleep(0.6)
    probe = await env.step(step_request("breaker", 1))
    await env.close()
    assert probe[0].reward == 1.0 and not env.circuit_open


async def test_unreachable_address_is_invalid_argument():
    env = RemoteEnvironment("nowhere", "127.0.0.1:1")
    with pytest.raises(InvalidArgument, match="unreachable"):
        await env.check_reachable(timeout_s=0.5)


@pytest.fixture
async def environment_service():
    server, port = await serve_environment()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield environment_pb2_grpc.EnvironmentServiceStub(channel)
    await server.stop(0)


async def test_service_answers_unavailable_within_the_callers_deadline_when_a_remote_hangs(environment_service,
                                                                                           faulty_remote):
    await environment_service.Register(environment_pb2.RegisterRequest(
        name="slow", address=faulty_remote.address, timeout_seconds=30))
    faulty_remote.servicer.mode = "hang"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await environment_service.Step(step_request("slow", 2), timeout=1.5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "remote environment 'slow'" in info.value.details()


async def test_unregistered_remote_still_serves_groups_leased_before_removal(environment_service, faulty_remote):
    await environment_service.Register(environment_pb2.RegisterRequest(name="leaving", address=faulty_remote.address))
    await environment_service.Unregister(environment_pb2.UnregisterRequest(name="leaving"))
    listed = await environment_service.List(environment_pb2.ListRequest())
    assert "leaving" not in listed.registered
    response = await environment_service.Step(step_request("leaving", 1), timeout=5)
    assert response.results[0].reward == 1.0


async def test_a_removed_remote_that_fails_is_not_found_at_once_so_rollout_drops_its_group(environment_service,
                                                                                          faulty_remote):
    """In the mix, a failing remote's call is UNAVAILABLE (the group is handed back until it answers); once removed,
    it will not come back, so the same failure is NOT_FOUND (rollout announces the group stale and the controller
    leases a prompt of the mix instead), without waiting out the removal's grace."""
    await environment_service.Register(environment_pb2.RegisterRequest(name="leaving", address=faulty_remote.address))
    faulty_remote.servicer.mode = "error"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await environment_service.Step(step_request("leaving", 1), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    await environment_service.Unregister(environment_pb2.UnregisterRequest(name="leaving"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await environment_service.Step(step_request("leaving", 1), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "removed from the mix and does not answer" in info.value.details(), info.value.details()

    faulty_remote.servicer.mode = "ok"  # answering again within the grace: its groups still finish
    response = await environment_service.Step(step_request("leaving", 1), timeout=5)
    assert response.results[0].reward == 1.0


async def test_registering_an_unreachable_remote_is_invalid_argument(environment_service):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await environment_service.Register(environment_pb2.RegisterRequest(name="gone", address="127.0.0.1:1"),
                                           timeout=15)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unreachable" in info.value.details()
