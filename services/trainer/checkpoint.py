"""Trainer checkpoints with NeMo RL's `checkpointing.*` keys: sharded, atomic, pruned to the best k.

    checkpoint_dir/step_N/          the state after N trainer steps (policy version N)
        training_info.json          {"step": N, "metrics": {...}} (the ranking metric among them)
        config.yaml                 the run's resolved config
        policy/                     torch DCP: model and optimizer, each rank its own shards
        scheduler.pt                the learning-rate schedule
        rng/rank_R.pt               each rank's torch (and CUDA) and Python RNG states
        hf/                         Hugging Face config, generation config, tokenizer (for export)
        run_state.json              what the run had consumed: steps 0..N-1, replay committed to N-1

Every rank writes into tmp_step_N; once all have finished, rank 0 renames it to step_N.
A crash mid-save leaves only a tmp_ directory, which is never resumed from and is removed
by the next save. So `latest()` only ever finds complete checkpoints.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.config import CheckpointingConfig, FlywheelConfig, dump_config, validation_key

STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True, slots=True)
class Saved:
    step: int
    """Trainer steps the checkpoint covers (its policy version)."""
    metric: float | None
    """Value of checkpointing.metric_name at that step; None when it was not reported."""
    pending: bool = False
    """A val: metric that is still to come: the controller validates this version and has not reported yet."""


def to_delete(saved: list[Saved], cfg: CheckpointingConfig) -> list[int]:
    """Steps to prune, as NeMo RL's remove_old_checkpoints: the latest always stays; of the periodic
    ones (step % save_period == 0) the best keep_top_k by metric (recency without one; ties prefer
    the newer) stay; other non-periodic ones go. keep_top_k null keeps every periodic one. A checkpoint whose
    validation is pending stays until a later save can rank it (NeMo RL validates before it saves; here the
    controller validates while the trainer goes on)."""
    if not saved:
        return []
    latest = max(s.step for s in saved)
    periodic = [s for s in saved if s.step % cfg.save_period == 0 and not s.pending]
    keep = {latest} | {s.step for s in saved if s.pending}
    if cfg.keep_top_k is None:
        keep |= {s.step for s in periodic}
    else:
        missing = float("-inf") if cfg.higher_is_better else float("inf")

        def rank(s: Saved) -> tuple[float, int]:
            value = s.step if cfg.metric_name is None else (missing if s.metric is None else s.metric)
            return (value if cfg.higher_is_better or cfg.metric_name is None else -value, s.step)

        keep |= {s.step for s in sorted(periodic, key=rank, reverse=True)[: cfg.keep_top_k]}
    return sorted(s.step for s in saved if s.step not in keep)


def metric_value(name: str | None, metrics: dict[str, float], validation: dict[str, float], n: int) -> float | None:
    """checkpointing.metric_name looked up as NeMo RL does: "train:reward_mean" in the saved step's metrics
    ("train/reward_mean"), "val:accuracy" in the validation of its policy version ("validation/accuracy"; "val:pass_k"
    is "validation/pass@n", n samples per validation prompt)."""
    if name is None:
        return None
    source, key = name.split(":", 1)
    return metrics.get(f"train/{key}") if source == "train" else validation.get(validation_key(key, n))


class Checkpointer:
    def __init__(self, cfg: FlywheelConfig, rank: int, world: int) -> None:
        self.cfg = cfg
        self.c = cfg.checkpointing
        self.rank = rank
        self.world = world
        self.root = Path(self.c.checkpoint_dir or Path(cfg.run.run_dir or ".") / "checkpoints")

    def due(self, version: int, final: bool) -> bool:
        return self.c.enabled and (version % self.c.save_period == 0 or final)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (tmp_ directories are never complete)."""
        found = [(int(m.group(1)), p) for p in self.root.glob("step_*")
                 if (m := STEP_DIR.match(p.name)) and (p / "training_info.json").exists()]
        return max(found)[1] if found else None

    def save(self, backend, version: int, metrics: dict[str, float],
             validated: dict[int, dict[str, float]] | None = None) -> Path:
        """Collective: every rank writes its shards, then rank 0 makes the checkpoint visible and prunes the
        others; `validated` (policy version -> validation metrics so far) ranks them by a val: metric."""
        tmp, final = self.root / f"tmp_step_{version}", self.root / f"step_{version}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        self._barrier()
        backend.save(tmp)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{self.rank}.pt")
        self._barrier()
        if self.rank == 0:
            self._finish(backend, tmp, final, version, metrics, validated or {})
        self._barrier()
        return final

    def _finish(self, backend, tmp: Path, final: Path, version: int, metrics: dict[str, float],
                validated: dict[int, dict[str, float]]) -> None:
        backend.hf_files(tmp / "hf")
        (tmp / "config.yaml").write_text(dump_config(self.cfg))
        (tmp / "run_state.json").write_text(json.dumps({"run": self.cfg.run.name, "next_step": version,
                                                        "replay_committed_step": version - 1}))
        info = {"step": version, "metrics": metrics}
        (tmp / "training_info.json").write_text(json.dumps(info))  # last file: marks it complete
        shutil.rmtree(final, ignore_errors=True)  # a leftover from a run that crashed after its rename
        tmp.rename(final)
        self._prune(validated)

    def _prune(self, validated: dict[int, dict[str, float]]) -> None:
        saved = []
        for path in self.root.glob("step_*"):
            if (m := STEP_DIR.match(path.name)) and (path / "training_info.json").exists():
                step, info = int(m.group(1)), json.loads((path / "training_info.json").read_text())
                metric = metric_value(self.c.metric_name, info["metrics"], validated.get(step, {}),
                                      self.cfg.grpo.val_num_generations_per_prompt)
                saved.append(Saved(step=step, metric=metric, pending=self._pending(step, validated)))
        for step in to_delete(saved, self.c):
            shutil.rmtree(self.root / f"step_{step}", ignore_errors=True)

    def _pending(self, step: int, validated: dict[int, dict[str, float]]) -> bool:
        """The controller will report a validation of `step` that ranks it: due, not reported, and no later
        version reported (validations run one at a time, in order: once a later one is in, this one never comes)."""
        return (self.c.ranks_by_validation and step not in validated
                and not any(v > step for v in validated) and self.cfg.has_validation_prompts
                and self.cfg.grpo.validation_due(step, final=False))

    def restore(self, backend, path: Path) -> int:
        """Collective: load `path` into the backend and this rank's RNG; returns the step to run next."""
        backend.load(path)
        rng = path / "rng" / f"rank_{self.rank}.pt"
        if rng.exists():  # absent when resuming on more ranks than saved
            _set_rng_state(torch.load(rng, weights_only=False))
        return int(json.loads((path / "training_info.json").read_text())["step"])

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
