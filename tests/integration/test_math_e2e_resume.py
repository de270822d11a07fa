"""Whole-system resume: stop every process mid-epoch, start them again on the same run directory, and
every prompt of the epoch is trained on exactly once.

What carries the run across: the trainer's checkpoint (weights, optimizer, step), the controller's
lease position in a NATS KV bucket (JetStream's file store in the run directory), the work queue
(JetStream) and replay's recorded batches (Redis with AOF, in the run directory).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import nats
import pytest
import redis

from test_math_e2e import _write

from services.common.bus import Subjects, nats_credentials
from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.common.data import plan_config
from services.local import LocalStack
from services.replay.store import key_prefix

pytestmark = pytest.mark.slow
PER_STEP, STEPS, ROWS = 2, 8, 16


class LeaseRecorder:
    """Every PromptGroup the controller publishes, seen by a plain NATS subscriber in a thread;
    `on_lease(group)` is called for each."""

    def __init__(self, url: str, subject: str, credentials: dict, on_lease=lambda group: None) -> None:
        self.credentials = credentials
        self.on_lease = on_lease
        self.groups: dict[str, str] = {}  # group id -> prompt id
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(url, subject)), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _run(self, url: str, subject: str) -> None:
        nc = await nats.connect(url, **self.credentials)

        async def on(msg) -> None:
            group = types_pb2.PromptGroup.FromString(msg.data)
            self.groups[group.group_id] = group.prompt_id
            self.on_lease(group)

        await nc.subscribe(subject, cb=on)
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await nc.drain()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _tombstones(stack: LocalStack) -> list[str]:
    """Ids of groups replay chose for a step and freed after a committed checkpoint (or evicted)."""
    prefix = key_prefix(stack.cfg.run.name)
    r = redis.Redis.from_url(stack.cfg.addresses.redis_url,
                             password=stack.cfg.security.redis_password.get_secret_value() or None)
    return [k.decode().removeprefix(prefix + "d:") for k in r.scan_iter(match=f"{prefix}d:*")]


def _run(cfg, run_dir: Path, until, leases: dict[str, str], pause_rollout_at: int | None = None) -> list[str]:
    """Runs until `until(rows)`, then stops everything. `pause_rollout_at`: SIGSTOP the rollout worker when
    the recorder sees the first group for that step, so a slow stop cannot let the run get far past it (in CI
    a stop that came ~3 s late once let the run finish its epoch before it). The recorder and the rollout
    get a lease at the same time, so the pause may land a step later; the test allows for that."""
    with LocalStack(cfg, run_dir) as stack:
        paused = []

        def on_lease(group) -> None:
            if group.target_step == pause_rollout_at and not paused:
                paused.append(stack.children.procs["rollout-0"].pid)
                os.kill(paused[0], signal.SIGSTOP)

        recorder = LeaseRecorder(stack.cfg.addresses.nats_url, Subjects(stack.cfg.run.name).work,
                                 nats_credentials(stack.cfg.security), on_lease)
        try:
            stack.start_services()
            rows = stack.wait_for(until, "training steps", timeout_s=900)
            for pid in paused:
                os.kill(pid, signal.SIGCONT)  # for the stop's SIGTERM; step 4's groups may still reach the trainer
            done = []
            if len(rows) >= STEPS:  # the last checkpoint is committed after the last report: wait for it
                deadline = time.monotonic() + 120
                while len(done := _tombstones(stack)) < ROWS and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            # The services stop before the recorder does, so every lease the controller publishes is recorded
            # (in CI the controller once leased step 5 after the recorder closed, and the next run trained it).
            stack.children.stop_services()
            recorder.close()
        leases.update(recorder.groups)
        return done


def test_stopping_everything_mid_epoch_and_starting_again_trains_each_prompt_once(tmp_path):
    overrides = [f"grpo.num_prompts_per_step={PER_STEP}", "grpo.max_num_epochs=1", "grpo.async_grpo.enabled=false",
                 "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "checkpointing.enabled=true", "checkpointing.save_period=3", "checkpointing.metric_name=null",
                 f"checkpointing.checkpoint_dir={tmp_path / 'run' / 'ckpt'}"]
    cfg, _ = plan_config(load_config(_write(tmp_path), overrides))
    assert cfg.grpo.max_num_steps == STEPS
    leases: dict[str, str] = {}
    # Steps 0-3 trained, the rollout paused once step 4 is leased: the checkpoint is step_3 (steps 0-2), so
    # step 3 (and maybe 4) was trained and must be trained again, on the batches replay recorded for it.
    _run(cfg, tmp_path / "run", lambda rows: len(rows) >= 4, leases, pause_rollout_at=4)
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["step_3"]
    trained = _run(cfg, tmp_path / "run", lambda rows: len(rows) >= STEPS and rows[-1]["step"] == STEPS - 1, leases)

    prompts = Counter(leases[g] for g in trained)
    assert len(trained) == ROWS and set(prompts.values()) == {1}, prompts
    assert {p.split("/")[-1] for p in prompts} == {str(i) for i in range(ROWS)}  # the whole epoch, once each
