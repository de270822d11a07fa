"""One micro-batch's forward pass: padded rows, or rows packed end to end into one sequence.

Padded (the default and dynamic batching): the rows are cut to the longest of them, so a
micro-batch of short samples costs short-sample compute. Packed (policy.sequence_packing):
the rows' real tokens are concatenated into one row, positions restart at 0 for each
sample, and a block-diagonal causal mask keeps attention inside each sample, so every
logprob equals the padded one (to float rounding). With context parallelism, padded rows whose positions
are split over the CP group (context_parallel.py). Either way the result is [rows, width - 1], aligned with
TrainBatch.targets cut to the same width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from services.common.config import PolicyConfig
from services.common.modeling import token_logprobs
from services.trainer.algorithms import LossInputs
from services.trainer.algorithms.packing import pack_rows, unpack_values
from services.trainer.backends.context_parallel import chunk_of, gather_positions
from services.trainer.batch import TrainBatch
from services.trainer.plan import padded_width


class Forward:
    def __init__(self, cfg: PolicyConfig, temperature: float, device: torch.device,
                 context: dist.ProcessGroup | None = None) -> None:
        self.cfg = cfg
        self.temperature = temperature
        self.device = device
        self.packing = cfg.sequence_packing.enabled
        self.context = context
        """With context parallelism: the group this rank splits each row's positions with (context_parallel.py)."""

    def budget(self, *, train: bool) -> int | None:
        """Token budget of a micro-batch when packing or dynamic batching is on, else None."""
        mode = self.cfg.sequence_packing if self.packing else self.cfg.dynamic_batching
        if not mode.enabled:
            return None
        return mode.train_mb_tokens if train else mode.logprob_mb_tokens

    def logprobs(self, model: torch.nn.Module, b: TrainBatch, rows: list[int]) -> Tensor:
        """[len(rows), width - 1] logprobs of the rows' targets (0 past each row's end)."""
        lengths = b.attention_mask[rows].sum(1)
        width = padded_width(lengths.tolist())
        ids = b.input_ids[rows, :width]
        if self.packing:
            return self._packed(model, ids, lengths)
        if self.context is not None:
            return self._context_parallel(model, ids)
        mask = b.attention_mask[rows, :width]
        logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return token_logprobs(logits[:, :-1], ids[:, 1:].to(self.device), self.temperature,
                              self.cfg.logprob_chunk_size)

    def logits(self, model: torch.nn.Module, b: TrainBatch, rows: list[int]) -> Tensor:
        """[len(rows), width - 1, V] the model's raw logits at each target's position (distillation's loss takes the
        whole vocabulary; temperature is the loss's to apply). Past a row's end: the padding's logits, or 0 packed."""
        lengths = b.attention_mask[rows].sum(1)
        width = padded_width(lengths.tolist())
        ids, d = b.input_ids[rows, :width], self.device
        if self.context is not None:
            raise ValueError("context parallelism gives logprobs, not the whole vocabulary's logits (distillation)")
        if not self.packing:
            mask = b.attention_mask[rows, :width]
            return model(input_ids=ids.to(d), attention_mask=mask.to(d)).logits[:, :-1]
        packed = pack_rows(ids, lengths)
        logits = model(input_ids=packed.input_ids.to(d), position_ids=packed.position_ids.to(d),
                       attention_mask=packed.attention_mask.to(d)).logits
        return unpack_values(logits[0, :-1], lengths, width - 1)

    def _packed(self, model: torch.nn.Module, ids: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_rows(ids, lengths)
        d = self.device
        logits = model(input_ids=packed.input_ids.to(d), position_ids=packed.position_ids.to(d),
                       attention_mask=packed.attention_mask.to(d)).logits
        values = token_logprobs(logits[:, :-1], packed.input_ids[:, 1:].to(d), self.temperature,
                                self.cfg.logprob_chunk_size)
        return unpack_values(values[0], lengths, ids.shape[1] - 1)

    def _context_parallel(self, model: torch.nn.Module, ids: Tensor) -> Tensor:
        """This rank's positions through the model (attention over the whole row), their logprobs gathered from
        the group into the whole row's [rows, width - 1], the same on every rank of the group."""
        local, positions, targets = chunk_of(ids, self.context)
        d = self.device
        logits = model(input_ids=local.to(d), position_ids=positions.to(d)).logits
        values = token_logprobs(logits, targets.to(d), self.temperature, self.cfg.logprob_chunk_size)
        return gather_positions(values, self.context, 1)[:, : ids.shape[1] - 1]

    def loss_inputs(self, data: LossInputs, rows: list[int], width: int) -> LossInputs:
        """The rows' loss inputs, cut to the micro-batch's width (targets are width long)."""
        def take(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            x = x[rows]
            return (x[:, :width] if x.dim() == 2 else x).to(self.device)
        return LossInputs(**{f: take(getattr(data, f)) for f in LossInputs.__slots__})
