"""Megatron-Core's context parallelism without Transformer Engine: megatron's own DotProductAttention refuses
context_parallel_size > 1, and Transformer Engine's attention, which has it, is not installed here.

    megatron's layout: a row of W positions (W a multiple of 2n) cut into 2n equal chunks; CP rank c holds
                       chunks c and 2n-1-c (zigzag_positions), so that every rank has as many keys to attend to.
                       GPTModel's RoPE takes that layout for granted (get_pos_emb_on_this_cp_rank).
    each attention layer: this rank's queries against the whole row's keys and values, all-gathered from the group
                       (ContextParallelAttention), causal over global positions
    logprobs:          this rank's positions' logprobs, all-gathered and put back in row order (whole_row), so the
                       loss is the whole row's on every rank of the group

Gradients: the logprobs' all-gather sums the group's n identical loss gradients back onto each rank's positions, and
megatron's schedule multiplies a step's loss by n as well, while its DDP averages over data-parallel x context-
parallel ranks: the backend divides its loss by n once to cancel (megatron.py). All-gather rather than ring
attention, through the FSDP2 backend's context parallelism's own attend_over_row (context_parallel.py), each backend
with its layout of positions: it holds a whole row's keys and values per layer. Tested on CPU with gloo against attention over the whole
row, values and gradients; megatron-core's forward around it needs CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from services.trainer.backends.context_parallel import attend_over_row, gather_positions


def zigzag_positions(width: int, n: int, rank: int) -> Tensor:
    """The global positions CP rank `rank` of `n` holds of a `width`-position row: chunks rank and 2n-1-rank of 2n."""
    if width % (2 * n):
        raise ValueError(f"a row of {width} positions does not split into {2 * n} chunks")
    k = width // (2 * n)
    return torch.cat([torch.arange(rank * k, (rank + 1) * k), torch.arange((2 * n - 1 - rank) * k, (2 * n - rank) * k)])


def group_positions(width: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's positions, in rank order: the order an all-gather over `group` puts their chunks in."""
    return torch.cat([zigzag_positions(width, group.size(), r) for r in range(group.size())])


def whole_row(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, W/n] values at this rank's positions -> [B, W] in row order, on every rank; differentiable."""
    width = local.shape[1] * group.size()
    order = torch.argsort(group_positions(width, group)).to(local.device)
    return gather_positions(local, group, 1)[:, order]


class ContextParallelAttention(MegatronModule):
    """The core attention of megatron-core's local layer spec under context parallelism (its constructor's and
    forward's signatures are DotProductAttention's). Queries [s/n, b, heads, d] of this rank's positions; keys and
    values [s/n, b, groups, d], gathered over the context-parallel group; returns [s/n, b, heads * d]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if (config.window_size is not None or config.apply_query_key_layer_scaling or config.softmax_type != "vanilla"
                or dropout):
            # Dropout would need megatron's RNG tracker to draw the same mask again when a layer is recomputed.
            raise ValueError("context parallelism without Transformer Engine: sliding windows, query-key layer "
                             "scaling, softmax offsets and attention dropout are not built")
        self.group = ps.get_context_parallel_group()
        self.scale = softmax_scale  # None: 1/sqrt(d), as megatron's default

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("context parallelism without Transformer Engine: attention biases and packed "
                             "sequences are not built")
        width = query.shape[0] * self.group.size()
        q_pos = zigzag_positions(width, self.group.size(), self.group.rank()).to(query.device)
        k_pos = group_positions(width, self.group).to(query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, d] -> [b, heads, s, d]
        out = attend_over_row(q, k, v, q_pos, k_pos, self.group, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
