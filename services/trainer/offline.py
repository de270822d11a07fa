"""What the trainer loop does differently for an offline run (SFT, DPO): the data's length and its validation.

The batches come from replay as under GRPO (the controller publishes the dataset's rows), so the loop
keeps Sample, checkpoints, StepReport and Commit; it skips weight sync (there is no rollout) and the
advantages, and calls the backend's offline step. The trainer reads data.train too, with the same
tokenizer and plan as the controller (common/data/offline_tokens.py), only to know where the run
ends: max_num_steps, or sooner when max_num_epochs of the data are used up.

Validation is the trainer's here, not rollout's: NeMo RL's SFT and DPO validate by the loss on
data.validation (no generation). Every val_period steps (val_at_start, val_at_end) the model scores
up to val_batches × val_global_batch_size validation examples (all with val_batches 0), normalized
over all of them at once, and the metrics go into the step's report as validation/* (SFT's loss as
NeMo RL names it, validation/val_loss) and into validation.jsonl; checkpoints rank by them
(checkpointing.metric_name val:val_loss, sft.yaml's) as under GRPO by the controller's.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.config import FlywheelConfig
from services.common.jsonl import read_rows
from services.common.data.offline_tokens import group_of, load_plan
from services.trainer.batch import TrainBatch, build_batch


class OfflineRun:
    def __init__(self, cfg: FlywheelConfig, tokenizer) -> None:
        self.cfg = cfg
        plan, validation, _ = load_plan(cfg, tokenizer)  # the controller logs the drops
        cfg.grpo.max_num_steps = plan.steps  # the last step reports itself final, as under GRPO
        loop = cfg.offline
        limit = loop.val_batches * loop.val_global_batch_size if loop.val_batches else len(validation)
        groups = [group_of(t, group_id=f"validation/{i}", step=0, env_name="validation", now_ns=0)
                  for i, t in enumerate(validation[:limit])]
        self.validation: TrainBatch | None = build_batch(groups, tokenizer.pad_token_id) if groups else None
        self.path = Path(cfg.run.run_dir or ".") / "validation.jsonl"
        self.validated: dict[int, dict[str, float]] = {
            row["version"]: {k: v for k, v in row.items() if k != "version"} for row in read_rows(self.path)}
        """Policy version -> its validation (a resumed run's included): checkpoints rank by it (val:val_loss)."""

    def due(self, version: int, final: bool) -> bool:
        """Validate the weights of `version` (steps done)?"""
        loop = self.cfg.offline
        if self.validation is None:
            return False
        if version == 0:
            return loop.val_at_start
        return (loop.val_period > 0 and version % loop.val_period == 0) or (final and loop.val_at_end)

    def record(self, version: int, metrics: dict[str, float]) -> dict[str, float]:
        """The validation's metrics under NeMo RL's names, appended to validation.jsonl."""
        named = {f"validation/{'val_loss' if k == 'loss' and self.cfg.algorithm == 'sft' else k}": v
                 for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"version": version, **named}) + "\n")
        self.validated[version] = named
        return named
