"""The FSDP2 policy: torch `fully_shard` over the data-parallel ranks, gloo on CPU, NCCL on GPU.

Every rank holds the whole step's batch (rank 0 fetches it and broadcasts) and trains on
its shard of rows; the loss is normalised by the step's global valid tokens, so the summed
gradient is the same for any micro-batch size or number of ranks (FSDP's mean reduction
is undone by scaling the loss with the world size).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from services.common.config import FlywheelConfig
from services.common.infra import free_port
from services.common.modeling import load_policy, token_logprobs
from services.trainer.algorithms import LossInputs, clipped_pg_loss
from services.trainer.batch import TrainBatch


def init_distributed() -> tuple[int, int]:
    """(rank, world_size): from torchrun's environment, else a single local rank."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        else:  # explicit arguments, not os.environ: child processes must not inherit a rendezvous
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size()


class FSDP2Policy:
    def __init__(self, cfg: FlywheelConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = init_distributed()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        model, self.tokenizer = load_policy(cfg.policy, cfg.run.seed, self.device)
        self.reference = None
        if cfg.loss_fn.reference_policy_kl_penalty > 0:  # frozen copy of the initial weights
            self.reference, _ = load_policy(cfg.policy, cfg.run.seed, self.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        o = cfg.policy.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay,
                                           betas=o.betas, eps=o.eps)
        self.temperature = cfg.policy.generation.temperature

    def _logprobs(self, model, b: TrainBatch) -> torch.Tensor:
        logits = model(input_ids=b.input_ids.to(self.device), attention_mask=b.attention_mask.to(self.device)).logits
        return token_logprobs(logits[:, :-1], b.targets.to(self.device), self.temperature)

    def _micro_batch_rows(self, n: int):
        """Row indices of this rank's micro-batches: rank r takes rows r, r + world, ..."""
        mine = torch.arange(self.rank, n, self.world)
        size = self.cfg.policy.train_micro_batch_size
        for start in range(0, len(mine), size):
            yield mine[start:start + size]

    @torch.no_grad()
    def logprobs(self, b: TrainBatch, model=None) -> torch.Tensor:
        """[B, L-1] logprobs of the targets under the current (or given) weights, all rows."""
        model = model or self.model
        return torch.cat([self._logprobs(model, b.rows(slice(i, i + self.cfg.policy.train_micro_batch_size))).cpu()
                          for i in range(0, len(b), self.cfg.policy.train_micro_batch_size)])

    def train_step(self, b: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the whole batch; returns summed loss metrics and the grad norm."""
        prev = self.logprobs(b)
        ref = self.logprobs(b, self.reference) if self.reference is not None else None
        mask = b.token_mask * b.sample_mask[:, None]
        totals = dict(global_valid_tokens=max(1.0, mask.sum().item()),
                      global_valid_seqs=max(1.0, b.sample_mask.sum().item()))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        full = LossInputs(prev_logprobs=prev, generation_logprobs=b.generation_logprobs, reference_logprobs=ref,
                          advantages=advantages, token_mask=b.token_mask, sample_mask=b.sample_mask)
        for rows in self._micro_batch_rows(len(b)):
            curr = self._logprobs(self.model, b.rows(rows))
            loss, m = clipped_pg_loss(curr, _subset(full, rows, self.device), self.cfg.loss_fn, **totals)
            (loss * self.world).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
        max_norm = self.cfg.policy.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.model.eval()
        metrics["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on rank 0 (CPU for gloo, device for NCCL); {} elsewhere."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=self.device.type == "cpu")
        return get_model_state_dict(self.model, options=opts)


def _subset(data: LossInputs, rows: torch.Tensor, device: torch.device) -> LossInputs:
    return LossInputs(**{f: (getattr(data, f)[rows].to(device) if getattr(data, f) is not None else None)
                         for f in data.__slots__})
