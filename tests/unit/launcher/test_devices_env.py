"""`flywheel up` gives each child process its GPUs: the environment the real children start with.

The host's GPUs are given to the planner as CUDA_VISIBLE_DEVICES (what it reads first); this machine has none,
so the children run their CPU code whatever they are shown. Each child's environment is read back from
/proc/<pid>/environ, as the kernel holds it, right after `LocalStack.start_services` spawned it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.devices import checked_plan, demand_of, plan
from services.local import INFRA, LocalStack, _serving, run_local

VLLM_NCCL = ["policy.generation.backend=vllm", "weight_sync.backend=nccl", "trainer.device=cuda"]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def test_each_child_of_flywheel_up_sees_only_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # a host with four GPUs
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    cfg = load_config(None, [*VLLM_NCCL, "trainer.nproc_per_node=2", "rollout.num_workers=2"])
    with LocalStack(cfg, tmp_path, checked_plan(cfg)) as stack:
        stack.start_services()
        env = {name: environ(proc.pid) for name, proc in stack.children.procs.items() if name not in INFRA}
    visible = {name: e.get("CUDA_VISIBLE_DEVICES") for name, e in env.items()}
    assert visible == {"environment": "0,1,2,3", "replay": "0,1,2,3", "controller": "0,1,2,3",  # inherited: no torch
                       "trainer": "0,1", "rollout-0": "2", "rollout-1": "3"}
    assert "CUDA_DEVICE_ORDER" not in env["trainer"]  # the indices are the launcher's own CUDA_VISIBLE_DEVICES'
    assert env["rollout-1"]["FLYWHEEL_RUN_TOKEN"] == env["trainer"]["FLYWHEEL_RUN_TOKEN"] != ""


def test_flywheel_up_refuses_nccl_on_one_gpu_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = load_config(None, VLLM_NCCL)
    held = tmp_path / "run"  # a directory run_local refuses at once too, so a build without the check fails fast
    held.mkdir()
    (held / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="weight_sync.backend: nccl between processes that share a device"):
        run_local(cfg, None, str(held))
    assert sorted(p.name for p in held.iterdir()) == ["metrics.jsonl"]


def test_on_one_gpu_rollout_starts_once_the_trainer_serves(tmp_path, monkeypatch):
    # vLLM would count the trainer's model load, were it at the same moment on the same GPU, against its own
    # memory. Without the wait, start_services returns milliseconds after spawning the trainer, long before
    # it imports torch and serves.
    # The plan of a one-GPU host with the trainer on it (trainer.device=cuda), while this CPU host's trainer
    # computes on CPU: it starts and serves here, with CUDA_VISIBLE_DEVICES=0 in its environment.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = load_config(None, ["policy.generation.backend=vllm", "checkpointing.enabled=false"])
    devices = plan(replace(demand_of(cfg), trainer_ranks=1), ["0"])
    assert devices.rollout_shares_the_trainers()
    with LocalStack(cfg, tmp_path, devices) as stack:
        stack.start_services()
        assert "rollout-0" in stack.children.procs
        assert asyncio.run(_serving("trainer", stack.cfg.addresses.trainer, stack.cfg.security))
