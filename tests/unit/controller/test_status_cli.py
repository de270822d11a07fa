"""`flywheel status` / `flywheel env` find the local run by themselves and print a person's summary."""

import asyncio
import json
import os
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.pb.flywheel.v1 import controller_pb2
from services.controller.client import format_status
from services.controller.discovery import RunNotFound, candidates, find_local_run


def _run_dir(root, name: str, controller: str, mtime: float):
    path = root / "runs" / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"addresses: {{controller: '{controller}'}}\ncontroller: {{auth_token: tok-{name}}}\n")
    os.utime(path / "config.yaml", (mtime, mtime))
    return path


async def _health_server():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_the_newest_run_whose_controller_answers_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_RUN_DIR", raising=False)

    async def go():
        server, address = await _health_server()
        try:
            now = time.time()
            live = _run_dir(tmp_path, "old-live", address, now - 100)
            _run_dir(tmp_path, "new-dead", "127.0.0.1:1", now)
            assert candidates(cwd=tmp_path)[0].name == "new-dead"
            run = await find_local_run(cwd=tmp_path)
            assert (run.run_dir, run.controller, run.token) == (live, address, "tok-old-live")
        finally:
            await server.stop(None)

    asyncio.run(go())


def test_no_live_run_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_RUN_DIR", raising=False)
    _run_dir(tmp_path, "gone", "127.0.0.1:1", time.time())
    with pytest.raises(RunNotFound, match="runs/gone .controller 127.0.0.1:1 not answering"):
        asyncio.run(find_local_run(cwd=tmp_path))


def test_status_is_a_readable_summary_not_json(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 9, "train/reward": 0.75, "train/avg_trajectory_age": 0.5,
                                                        "timing/train/total_step_time": 0.25}) + "\n")
    (tmp_path / "validation.jsonl").write_text(json.dumps({"version": 10, "validation/accuracy": 0.5,
                                                           "validation/pass@4": 0.8}) + "\n")
    status = controller_pb2.StatusResponse(loaded_version=10, trained_step=9, next_target_step=11,
                                           outstanding_groups=32, rollout_workers=["rollout-a"])
    envs = [controller_pb2.EnvironmentStatus(spec=controller_pb2.EnvironmentSpec(name="math", kind="math", weight=1),
                                             leased_groups=160)]
    text = format_status(status, envs, tmp_path, "127.0.0.1:5")
    assert text.splitlines() == [
        f"run running: controller 127.0.0.1:5, run dir {tmp_path}",
        "  steps trained 10; rollout serves version 10 (1 worker); leasing for step 11",
        "  groups leased and not yet trained: 32; leased again after going stale: 0",
        "  last step 10: reward 0.750, trajectory age 0.50, step time 0.25 s",
        "  validation at version 10: accuracy 0.500 pass@4 0.800",
        "  environment math: weight 1, 160 groups leased (math)",
    ]
