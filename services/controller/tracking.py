"""Where a run's metrics go besides metrics.jsonl: TensorBoard always, W&B and MLflow when configured.

    trainer StepReport ──train/*, timing/*──┐
    controller (replay size, validation) ───┴──▶ Tracker.log(metrics, step) ──▶ <run_dir>/<log_dir>/tensorboard
                                                                             ├─▶ wandb   (logger.wandb_enabled)
                                                                             └─▶ mlflow  (logger.mlflow_enabled)

The step axis is the policy version: train metrics of step s are logged at s + 1 (the weights they
made), validation of version v at v, so val_at_start sits at 0, as in NeMo RL's logs. TensorBoard
events are written with the `tensorboard` package's own writer, which imports no torch.
"""

from __future__ import annotations

import time
from pathlib import Path

from services.common.config import FlywheelConfig


class TrackerError(RuntimeError):
    """A configured tracker that cannot start (its package is missing)."""


def tensorboard_dir(cfg: FlywheelConfig) -> Path:
    return Path(cfg.run.run_dir or ".") / cfg.logger.log_dir / "tensorboard"


def check_trackers(cfg: FlywheelConfig) -> None:
    """Raises TrackerError naming the logger key whose package is not installed."""
    for key, module in (("wandb_enabled", "wandb"), ("mlflow_enabled", "mlflow")):
        if getattr(cfg.logger, key):
            try:
                __import__(module)
            except ImportError:
                raise TrackerError(f"logger.{key}: true, but the {module} package is not installed") from None


class Tracker:
    def __init__(self, cfg: FlywheelConfig) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        check_trackers(cfg)
        path = tensorboard_dir(cfg)
        path.mkdir(parents=True, exist_ok=True)
        self.tb = EventFileWriter(str(path), flush_secs=5)
        self.wandb = self._wandb(cfg) if cfg.logger.wandb_enabled else None
        self.mlflow = self._mlflow(cfg) if cfg.logger.mlflow_enabled else None

    @staticmethod
    def _wandb(cfg: FlywheelConfig):
        import wandb

        w = cfg.logger.wandb
        return wandb.init(project=w.project, name=w.name or cfg.run.name, config=cfg.model_dump(mode="json"))

    @staticmethod
    def _mlflow(cfg: FlywheelConfig):
        import mlflow

        m = cfg.logger.mlflow
        if m.tracking_uri:
            mlflow.set_tracking_uri(m.tracking_uri)
        mlflow.set_experiment(m.experiment_name)
        mlflow.start_run(run_name=m.run_name or cfg.run.name)
        return mlflow

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in sorted(metrics.items())]
        self.tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)))
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("@", "_at_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
