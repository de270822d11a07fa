"""The run token on a real grpc.aio server, and credentials in the config: from the environment, never dumped."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import SecretStr

from services.common.config import SecurityConfig, dump_config, load_config
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc
from services.common.security import RUN_TOKEN_KEY, run_token_interceptors, secret_env, with_local_credentials
from services.common.server import ErrorInterceptor, channel

TOKEN = "unit-run-token"


class Replay(replay_pb2_grpc.ReplayServiceServicer):
    async def Stats(self, request, context):
        return replay_pb2.StatsResponse(capacity=5)


@pytest.fixture
async def address():
    security = SecurityConfig(run_token=TOKEN)
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *run_token_interceptors(security)])
    replay_pb2_grpc.add_ReplayServiceServicer_to_server(Replay(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _stats(address: str, security: SecurityConfig | None, metadata=()) -> grpc.StatusCode:
    async with channel(address, security=security) as ch:
        try:
            await replay_pb2_grpc.ReplayServiceStub(ch).Stats(replay_pb2.StatsRequest(), timeout=10,
                                                                metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            return err.code()


async def test_a_channel_with_the_runs_security_carries_the_token(address):
    assert await _stats(address, SecurityConfig(run_token=TOKEN)) == grpc.StatusCode.OK


@pytest.mark.parametrize("security, metadata", [
    (None, ()),
    (SecurityConfig(run_token="another"), ()),
    (None, ((RUN_TOKEN_KEY, ""),)),
    (None, (("authorization", f"Bearer {TOKEN}"),)),  # the admin header is not the run token
])
async def test_internal_rpcs_without_the_run_token_are_unauthenticated(address, security, metadata):
    assert await _stats(address, security, metadata) == grpc.StatusCode.UNAUTHENTICATED


async def test_health_checks_need_no_run_token(address):
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_run_token_means_no_check():
    assert run_token_interceptors(SecurityConfig()) == []


def test_credentials_come_from_the_environment_where_the_config_leaves_them_empty(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_RUN_TOKEN", "from-env")
    monkeypatch.setenv("FLYWHEEL_REDIS_PASSWORD", "redis-from-env")
    cfg = load_config(None, ["security.redis_password=from-file"])
    assert cfg.security.run_token.get_secret_value() == "from-env"
    assert cfg.security.redis_password.get_secret_value() == "from-file"


def test_credentials_are_never_dumped_or_shown(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_NATS_TOKEN", "nats-secret")
    cfg = load_config(None, ["security.run_token=run-secret", "security.nats_user=alice",
                             "security.nats_password=pw-secret", "security.redis_password=redis-secret"])
    shown = dump_config(cfg) + repr(cfg)
    for secret in ("run-secret", "nats-secret", "pw-secret", "redis-secret"):
        assert secret not in shown


def test_local_credentials_fill_the_gaps_and_travel_as_environment_variables():
    configured = SecurityConfig(redis_password=SecretStr("mine"))
    local = with_local_credentials(configured)
    env = secret_env(local)
    assert env["FLYWHEEL_REDIS_PASSWORD"] == "mine"
    assert len(env["FLYWHEEL_RUN_TOKEN"]) >= 32 and len(env["FLYWHEEL_NATS_TOKEN"]) >= 32
    assert with_local_credentials(configured).run_token != local.run_token  # fresh per run


@pytest.mark.parametrize("fields", [{"tls_cert": "c.pem"}, {"tls_mutual": True}, {"tls_cert": "c", "tls_key": "k"}])
def test_incomplete_tls_settings_are_refused(fields):
    with pytest.raises(ValueError):
        SecurityConfig(**fields)
