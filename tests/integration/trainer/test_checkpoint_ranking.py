"""checkpointing.metric_name val:accuracy ranks checkpoints by the controller's validations: the controller's
StateStore puts each one in the run's NATS KV bucket, the trainer reads them there at every save, and the
checkpointer keeps the best keep_top_k of the validated ones, the latest, and those whose validation is
still to come. A real NATS server and real FSDP2 checkpoints of the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import torch

from services.common.bus import Bus
from services.common.config import load_config
from services.controller.state import StateStore
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.checkpoint import Checkpointer
from services.trainer.distributed import init_distributed
from services.trainer.main import Trainer, Validations

RUN = "ranking"
ACCURACY = {10: 0.9, 20: 0.2, 30: 0.5}


class Reports:
    """The controller's StateStore reporting validations, and the trainer's reader (`Validations`, which reads only
    the versions it has not read before), on one connection and one event loop that outlive the saves."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.bus = self.loop.run_until_complete(Bus.connect(url, RUN, name="test"))
        self.state = self.loop.run_until_complete(StateStore.open(self.bus.js, RUN))
        self.reader = Validations(self.bus, RUN)

    def report(self, version: int) -> dict[int, dict[str, float]]:
        """The controller reports version's validation; returns what the trainer then reads."""
        metrics = {"validation/accuracy": ACCURACY[version], "validation/avg_length": 3.0}
        self.loop.run_until_complete(self.state.save_validated(version, metrics))
        return self.loop.run_until_complete(self.reader.read("checkpoint ranking"))

    def close(self) -> None:
        self.loop.run_until_complete(self.bus.close())
        self.loop.close()


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))


def test_checkpoints_are_ranked_by_the_validations_the_controller_reports(tmp_path, nats_server):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", f"run.name={RUN}", "checkpointing.save_period=10",
                             "checkpointing.keep_top_k=1", "checkpointing.metric_name=val:accuracy",
                             "grpo.val_period=10"])
    assert cfg.has_validation_prompts  # the default toy environment generates its validation prompts
    info = init_distributed(120)
    reports = Reports(nats_server.url)
    try:
        backend = FSDP2Backend(cfg, info)
        checkpointer = Checkpointer(cfg, info.rank, info.world)
        root = checkpointer.root
        validated: dict[int, dict[str, float]] = {}
        checkpointer.save(backend, 10, {}, validated)
        assert _steps(root) == [10]
        validated = reports.report(10)
        assert validated == {10: {"validation/accuracy": 0.9, "validation/avg_length": 3.0}}
        checkpointer.save(backend, 20, {}, validated)
        assert _steps(root) == [10, 20]  # 20 is the latest; its validation is still to come
        checkpointer.save(backend, 30, {}, validated)
        assert _steps(root) == [10, 20, 30]  # 20 still pending: nothing ranks it yet
        validated = reports.report(20)
        checkpointer.save(backend, 40, {}, validated)
        assert _steps(root) == [10, 30, 40]  # 20 (0.2) ranked below 10 (0.9); 30 pending
        validated = reports.report(30)
        assert sorted(validated) == [10, 20, 30]  # the earlier ones kept, the new one read
        checkpointer.save(backend, 50, {}, validated)
        assert _steps(root) == [10, 40, 50]  # 30 (0.5) below 10; 40 pending; 50 the latest
    finally:
        reports.close()
        torch.distributed.destroy_process_group()


def test_without_a_val_metric_the_newest_stay_and_nothing_waits_for_validation(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "checkpointing.save_period=10", "checkpointing.keep_top_k=2",
                             "grpo.val_period=10"])
    info = init_distributed(120)
    try:
        backend = FSDP2Backend(cfg, info)
        checkpointer = Checkpointer(cfg, info.rank, info.world)
        for version in (10, 20, 30):
            checkpointer.save(backend, version, {}, {})
        assert _steps(checkpointer.root) == [20, 30]
    finally:
        torch.distributed.destroy_process_group()


def test_an_unreadable_state_bucket_ranks_nothing_rather_than_failing_the_save(nats_server, caplog):
    cfg = load_config(None, [f"run.name={RUN}", "checkpointing.metric_name=val:accuracy", "grpo.val_period=10"])

    async def read_after_the_connection_is_gone() -> dict:
        bus = await Bus.connect(nats_server.url, RUN, name="trainer")
        await bus.close()
        return await Trainer._validated(SimpleNamespace(cfg=cfg, offline=None, validations=Validations(bus, RUN)))

    assert asyncio.run(read_after_the_connection_is_gone()) == {}
    assert "cannot be read" in caplog.text
