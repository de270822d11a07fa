"""TLS and mutual TLS end to end: real service processes, certificates from a throwaway CA."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import nats
import pytest
import redis.exceptions
from redis.asyncio import Redis

from certs import make_pki
from services.common.config import SecurityConfig, load_config, write_resolved
from services.common.infra import child_env, free_port
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc
from services.common.security import secret_env
from services.common.server import channel
from services.controller.client import ControllerClient
from services.controller.discovery import find_local_run
from services.local import LocalStack

TOKEN = "tls-test-run-token"


def _tls(pki, mutual: bool) -> list[str]:
    return [f"security.tls_cert={pki.cert}", f"security.tls_key={pki.key}", f"security.tls_ca={pki.ca}",
            f"security.tls_mutual={str(mutual).lower()}"]


@pytest.fixture
def environment_service(tmp_path):
    """Start `flywheel serve environment` with the given TLS overrides; yields its address."""
    procs = []

    def start(overrides: list[str]) -> str:
        address = f"127.0.0.1:{free_port()}"
        cfg = load_config(None, [f"addresses.environment={address}", *overrides])
        path = write_resolved(cfg, tmp_path / f"env-{len(procs)}")
        log = (tmp_path / f"env-{len(procs)}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "environment", "--config",
                                       str(path)], stdout=log, stderr=subprocess.STDOUT,
                                      env=child_env({"FLYWHEEL_RUN_TOKEN": TOKEN})))
        _wait_listening(procs[-1], address, tmp_path / f"env-{len(procs) - 1}.log")
        return address

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _wait_listening(proc: subprocess.Popen, address: str, log) -> None:
    """Until the service accepts TCP connections; fails with its log if it exits first."""
    host, port = address.rsplit(":", 1)
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the environment service exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)


def _client(pki=None, *, mutual: bool = False, cert=None) -> SecurityConfig:
    fields = {"run_token": TOKEN}
    if pki is not None:
        fields |= {"tls_ca": str(pki.ca)}
    if mutual:
        fields |= {"tls_cert": str(cert.cert), "tls_key": str(cert.key), "tls_mutual": True, "tls_ca": str(pki.ca)}
    return SecurityConfig(**fields)


async def _list(address: str, security: SecurityConfig | None, timeout: float = 60) -> grpc.StatusCode:
    async with channel(address, security=security) as ch:
        try:
            await environment_pb2_grpc.EnvironmentServiceStub(ch).List(environment_pb2.ListRequest(),
                                                                       timeout=timeout, wait_for_ready=True)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            return err.code()


async def test_a_tls_server_answers_tls_clients_and_not_plaintext_ones(tmp_path, environment_service):
    pki = make_pki(tmp_path / "pki")
    address = environment_service(_tls(pki, mutual=False))
    assert await _list(address, _client(pki)) == grpc.StatusCode.OK
    plaintext = SecurityConfig(run_token=TOKEN)
    assert await _list(address, plaintext, timeout=3) in (grpc.StatusCode.UNAVAILABLE,
                                                          grpc.StatusCode.DEADLINE_EXCEEDED)
    untrusting = _client(make_pki(tmp_path / "other", name="other"))  # trusts another CA only
    assert await _list(address, untrusting, timeout=3) in (grpc.StatusCode.UNAVAILABLE,
                                                           grpc.StatusCode.DEADLINE_EXCEEDED)
    assert await _list(address, SecurityConfig(tls_ca=str(pki.ca))) == grpc.StatusCode.UNAUTHENTICATED


async def test_a_mutual_tls_server_refuses_clients_without_a_certificate_from_its_ca(tmp_path, environment_service):
    pki = make_pki(tmp_path / "pki")
    address = environment_service(_tls(pki, mutual=True))
    assert await _list(address, _client(pki, mutual=True, cert=pki)) == grpc.StatusCode.OK
    no_cert = _client(pki)
    assert await _list(address, no_cert, timeout=3) in (grpc.StatusCode.UNAVAILABLE,
                                                        grpc.StatusCode.DEADLINE_EXCEEDED)
    stranger = make_pki(tmp_path / "stranger", name="stranger")  # a certificate another CA signed
    assert await _list(address, _client(pki, mutual=True, cert=stranger), timeout=3) in (
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.slow
def test_a_local_run_trains_over_mutual_tls_with_every_credential_and_logs_none(tmp_path):
    pki = make_pki(tmp_path / "pki")
    cfg = load_config(None, ["grpo.max_num_steps=3", *_tls(pki, mutual=True)])
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= 3, "3 steps", timeout_s=600)
        secrets = secret_env(stack.cfg.security)
        brokers = asyncio.run(_brokers_without_credentials(stack))
        status = asyncio.run(_status_through_discovery(tmp_path / "run"))
        by_address = subprocess.run(  # a client elsewhere names the controller and brings its own certificate
            [sys.executable, "-m", "services.cli", "status", "--json", "--controller", stack.cfg.addresses.controller,
             "--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)],
            capture_output=True, text=True, timeout=60)
        logs = {p.name: p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log")}
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert status.trained_step >= 2  # `flywheel status` finds the run and speaks TLS to its controller
    assert by_address.returncode == 0 and '"trainedStep"' in by_address.stdout, by_address.stderr
    assert set(secrets) == {"FLYWHEEL_RUN_TOKEN", "FLYWHEEL_NATS_TOKEN", "FLYWHEEL_REDIS_PASSWORD"}
    assert brokers == {"nats": "refused", "redis": "refused"}
    for service in ("controller", "environment", "replay", "trainer", "rollout-0"):
        assert "(mTLS, run token)" in logs[f"{service}.log"], service
    written = [(tmp_path / "run" / "config.yaml").read_text(), *logs.values()]
    for var, secret in secrets.items():
        assert not [text for text in written if secret in text], f"{var} appears in the config or a log"
    assert not set(secrets) & set(os.environ), "the launcher put credentials in its own environment"


async def _status_through_discovery(run_dir):
    run = await find_local_run(str(run_dir))
    client = ControllerClient(run.controller, run.token, tls=run.tls, timeout_s=30)
    try:
        return await client.status()
    finally:
        await client.close()


async def _brokers_without_credentials(stack: LocalStack) -> dict[str, str]:
    """What NATS and Redis answer a client that has no credentials."""
    out = {}
    try:
        nc = await nats.connect(stack.cfg.addresses.nats_url, max_reconnect_attempts=0, connect_timeout=5,
                                allow_reconnect=False)
        await nc.close()
        out["nats"] = "accepted"
    except nats.errors.Error as err:  # the server's own verdict; a refused connection or a time-out is not one
        out["nats"] = "refused" if "Authorization Violation" in str(err) else repr(err)
    client = Redis.from_url(stack.cfg.addresses.redis_url)
    try:
        await client.ping()
        out["redis"] = "accepted"
    except redis.exceptions.AuthenticationError:
        out["redis"] = "refused"
    finally:
        await client.aclose()
    return out
