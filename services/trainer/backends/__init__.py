"""Training backends: one interface, one factory keyed on the config.

The trainer loop (services/trainer/main.py) never branches on the backend. Every method
here is a collective: all ranks call it, in the same order (main.py's Lockstep sees to it).

- fsdp2.py: torch FSDP2 (`fully_shard`) over the data-parallel ranks; CPU (gloo) or GPU (NCCL);
  tensor_parallel.py splits the model over TP ranks first, by its Hugging Face plan.
- megatron.py: Megatron-Core with tensor and pipeline parallelism; CUDA only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from torch import Tensor

from services.common.config import FlywheelConfig
from services.trainer.batch import TrainBatch
from services.trainer.distributed import RankInfo


class TrainingBackend(ABC):
    rank: int
    world: int
    tokenizer: object
    """The policy's Hugging Face tokenizer (pad id for batches; saved with checkpoints)."""

    @abstractmethod
    def train_step(self, batch: TrainBatch, advantages: Tensor) -> dict[str, float]:
        """One trainer step on the whole batch: its optimizer steps, then one scheduler step.

        Returns the loss metrics (NeMo RL names), grad_norm and lr, the same on every rank."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded weights with Hugging Face names in the policy's precision, on rank 0; {} elsewhere."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write model, optimizer and scheduler state under `directory` (each rank its shards)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; the same number of ranks is not required for FSDP2."""

    @abstractmethod
    def hf_files(self, directory: Path) -> None:
        """Rank 0: write the Hugging Face config, generation config and tokenizer (for export)."""


def make_backend(cfg: FlywheelConfig, info: RankInfo) -> TrainingBackend:
    if cfg.policy.megatron_cfg.enabled:
        from services.trainer.backends.megatron import MegatronBackend

        return MegatronBackend(cfg, info)
    from services.trainer.backends.fsdp2 import FSDP2Backend

    return FSDP2Backend(cfg, info)
