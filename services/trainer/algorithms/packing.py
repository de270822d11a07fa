"""Sequence packing (pure): rows of different lengths as one sequence, and back.

    rows   [a0 a1 a2 _ _]      packed ids  [a0 a1 a2 b0 b1]
           [b0 b1 _ _ _]  ─▶   positions   [ 0  1  2  0  1]
                               mask        causal inside a, causal inside b, nothing across

The mask is [1, 1, T, T] bool (True = may attend): a Hugging Face model takes it as is, so
attention never crosses a sample boundary and each sample's logits equal its unpacked ones.
Logprobs of the packed sequence map back to [rows, width]: sample i's targets are its own
tokens 1..n_i-1, predicted at packed positions o_i..o_i+n_i-2; the prediction at a sample's
last token (of the next sample's first token) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class Packed:
    input_ids: Tensor
    """[1, T] long: the rows' real tokens end to end, T = Σ lengths."""
    position_ids: Tensor
    """[1, T] long: 0..n_i-1 for each sample."""
    attention_mask: Tensor
    """[1, 1, T, T] bool: block-diagonal causal."""


def pack_rows(ids: Tensor, lengths: Tensor) -> Packed:
    """ids [R, W] right-padded, lengths [R] -> one packed sequence."""
    lengths = lengths.long()
    tokens = torch.cat([ids[i, :n] for i, n in enumerate(lengths.tolist())])
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(len(tokens)) - starts[segment]
    causal = torch.tril(torch.ones(len(tokens), len(tokens), dtype=torch.bool))
    mask = (segment[:, None] == segment[None, :]) & causal
    return Packed(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask[None, None])


def unpack_values(values: Tensor, lengths: Tensor, width: int) -> Tensor:
    """values [T-1, ...] (prediction at packed position p of token p+1: a logprob, or distillation's logits [T-1, V])
    -> [R, width, ...], 0 past each row's targets."""
    out = values.new_zeros(len(lengths), width, *values.shape[1:])
    offset = 0
    for i, n in enumerate(lengths.tolist()):
        out[i, : n - 1] = values[offset: offset + n - 1]
        offset += n
    return out
