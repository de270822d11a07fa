"""Full stack: a remote environment submitted by a separate client joins a running job, trains, and leaves.

One run (LocalStack, auth on) serves every test here: bad specs and missing tokens are refused with
clear errors while the run keeps stepping; examples/remote_env_server.py, submitted by
examples/submit_env.py from another process, shows up in replay and in the per-environment
reward metric, and after `flywheel env remove` no new group of it is trained.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from services.common.config import load_config
from services.common.pb.flywheel.v1 import controller_pb2, replay_pb2, replay_pb2_grpc, types_pb2
from services.common.server import channel
from services.controller.client import ControllerClient
from services.local import LocalStack

from env_harness import REPO, start_example_server

TOKEN = "t0ken"
NAME = "first_char"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = load_config(None, ["grpo.max_num_steps=1000", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "grpo.async_grpo.max_trajectory_age_steps=1",
                             f"controller.auth_token={TOKEN}"])
    with LocalStack(cfg, tmp_path_factory.mktemp("run")) as stack:
        stack.start_services()
        yield stack


def wait_until(stack: LocalStack, done, what: str, timeout_s: float = 60) -> list[dict]:
    return stack.wait_for(done, what, timeout_s)


def admin(stack: LocalStack, token: str = TOKEN) -> ControllerClient:
    return ControllerClient(stack.cfg.addresses.controller, token=token, timeout_s=20)


async def refusal(stack: LocalStack, spec: controller_pb2.EnvironmentSpec) -> grpc.aio.AioRpcError:
    client = admin(stack)
    try:
        await client.submit(spec)
    except grpc.aio.AioRpcError as err:
        return err
    finally:
        await client.close()
    raise AssertionError(f"{spec.name} was accepted")


def test_admin_api_needs_the_bearer_token(stack):
    wait_until(stack, lambda rows: len(rows) >= 1, "the first step", timeout_s=120)

    async def go():
        anonymous, authorized = admin(stack, token=""), admin(stack)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await anonymous.list()
        names = [e.spec.name for e in await authorized.list()]
        await anonymous.close(), await authorized.close()
        return info.value, names

    err, names = asyncio.run(go())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert names == ["toy"]


def test_bad_specs_get_clear_errors_and_the_run_keeps_stepping(stack, tmp_path):
    row = types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content="copy 1")])
    cases = [
        (controller_pb2.EnvironmentSpec(name="chess", kind="chess", weight=1), grpc.StatusCode.INVALID_ARGUMENT,
         "unknown environment kind 'chess'"),
        (controller_pb2.EnvironmentSpec(name="toy", kind="toy_copy", weight=1), grpc.StatusCode.ALREADY_EXISTS,
         "'toy' is already in the mix"),
        (controller_pb2.EnvironmentSpec(name="gone", address="127.0.0.1:1", rows=[row], weight=1),
         grpc.StatusCode.INVALID_ARGUMENT, "127.0.0.1:1 is unreachable"),
        (controller_pb2.EnvironmentSpec(name="nodata", kind="math", weight=1), grpc.StatusCode.INVALID_ARGUMENT,
         "'nodata' has an empty dataset"),
        (controller_pb2.EnvironmentSpec(name="neg", kind="toy_copy", weight=-1), grpc.StatusCode.INVALID_ARGUMENT,
         "neg: weight must be >= 0, got -1"),
    ]
    before = len(wait_until(stack, lambda rows: len(rows) >= 1, "the first step", timeout_s=120))
    for spec, code, message in cases:
        err = asyncio.run(refusal(stack, spec))
        assert (err.code(), message in err.details()) == (code, True), f"{spec.name}: {err.code()} {err.details()}"
    wait_until(stack, lambda rows: len(rows) >= before + 3, "steps after the refusals")


def test_submitted_remote_env_trains_and_stops_after_remove(stack):
    server, address = start_example_server()
    controller = stack.cfg.addresses.controller
    try:
        submitted = subprocess.run(
            [sys.executable, str(REPO / "examples" / "submit_env.py"), "--controller", controller,
             "--address", address, "--name", NAME, "--weight", "1", "--token", TOKEN],
            capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        assert f"submitted {NAME}: 50 prompts" in submitted.stdout

        key = f"train/reward_mean/{NAME}"
        rows = wait_until(stack, lambda rows: sum(key in r for r in rows) >= 2, f"{key} in metrics")
        trained = [r for r in rows if key in r]
        assert all(0.0 <= r[key] <= 1.0 for r in trained)
        groups = sampled_groups_of_a_step_not_yet_committed(stack, key, len(trained))
        assert NAME in {g.env_name for g in groups}

        removed = subprocess.run(
            [sys.executable, "-m", "services.cli", "env", "--controller", controller, "--token", TOKEN,
             "remove", NAME], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert removed.returncode == 0, removed.stderr
        first_clean = asyncio.run(next_target_step(stack))
        rows = wait_until(stack, lambda rows: rows and rows[-1]["step"] >= first_clean + 5, "steps after removal")
        assert not [r["step"] for r in rows if r["step"] >= first_clean and key in r], "trained after removal"
    finally:
        server.terminate()
        server.wait(timeout=10)


async def sampled_groups(stack: LocalStack, step: int) -> list[types_pb2.TrajectoryGroup]:
    g = stack.cfg.grpo
    async with channel(stack.cfg.addresses.replay, security=stack.cfg.security) as ch:  # sampled: replayed as is
        response = await replay_pb2_grpc.ReplayServiceStub(ch).Sample(replay_pb2.SampleRequest(
            step=step, prompts_per_step=g.num_prompts_per_step, max_staleness=g.max_staleness), timeout=20)
    return list(response.groups)


def sampled_groups_of_a_step_not_yet_committed(stack: LocalStack, key: str, seen: int,
                                               tries: int = 3) -> list[types_pb2.TrajectoryGroup]:
    """The batch of the newest step that trained on `key`'s environment. A checkpoint committed at that step
    meanwhile has let replay delete its batch (INVALID_ARGUMENT): then the next such step's."""
    for _ in range(tries):
        rows = wait_until(stack, lambda rows, seen=seen: sum(key in r for r in rows) >= seen,
                          f"{seen} rows with {key}")
        trained = [r for r in rows if key in r]
        try:
            return asyncio.run(sampled_groups(stack, trained[-1]["step"]))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT or "committed" not in (err.details() or ""):
                raise
            seen = len(trained) + 1
    raise AssertionError(f"every step that trained on {key} was committed before its batch could be read")


async def next_target_step(stack: LocalStack) -> int:
    client = admin(stack)
    try:
        return (await client.status()).next_target_step
    finally:
        await client.close()
