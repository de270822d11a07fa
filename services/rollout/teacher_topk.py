"""The teacher's top-k at the completion positions of padded rows, and the checks on what it is asked to score.
Pure: no IO, no model (tests/unit/rollout/test_teacher_topk.py holds the slow reference).

A row is prompt + completion, right-padded to the batch's width. Completion token t (0-based) sits at absolute
position P + t, so the logits that predict it are those at position P + t - 1 (Completion.teacher's alignment):
row i's n_i positions start at P_i - 1. A prompt must therefore have at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import require

MAX_COMPLETIONS = 64
"""Completions one Score request may carry (rollout.proto ScoreRequest: 1..64)."""


@dataclass(kw_only=True, slots=True)
class Row:
    """One sequence to score: `ids` = prompt + completion; the completion is the last `n` of them."""

    ids: list[int]
    n: int

    @property
    def start(self) -> int:
        """Position whose logits predict the first completion token."""
        return len(self.ids) - self.n - 1


def check_request(prompt: list[int], completions: list[list[int]], *, vocab_size: int, max_len: int) -> None:
    """InvalidArgument, with the offending field, for a request the teacher cannot score."""
    require(len(completions) > 0, "completions must not be empty")
    require(len(completions) <= MAX_COMPLETIONS,
            f"completions: {len(completions)} of them, at most {MAX_COMPLETIONS} per request")
    require(len(prompt) > 0, "prompt_token_ids must not be empty: the first completion token is predicted at the "
                             "prompt's last position")
    _check_ids(prompt, "prompt_token_ids", vocab_size)
    for i, ids in enumerate(completions):
        _check_ids(ids, f"completions[{i}]", vocab_size)
        require(len(prompt) + len(ids) <= max_len,
                f"completions[{i}]: prompt ({len(prompt)}) + completion ({len(ids)}) tokens exceed {max_len} "
                f"(policy.max_total_sequence_length)")


def _check_ids(ids: list[int], field: str, vocab_size: int) -> None:
    if ids:
        low, high = min(ids), max(ids)
        require(low >= 0 and high < vocab_size,
                f"{field}: token id {low if low < 0 else high} is outside the teacher's vocabulary [0, {vocab_size})")


def chunks(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """Consecutive runs of rows whose padded size (rows x longest) stays within max_tokens; a longer row goes
    alone."""
    out: list[list[Row]] = []
    for row in rows:
        if out and (len(out[-1]) + 1) * max(len(row.ids), *(len(r.ids) for r in out[-1])) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def padded(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, width], right-padded: padding after a row's tokens cannot change its
    logits under causal attention, and its positions stay 0..len-1."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = torch.tensor(r.ids)
        mask[i, :len(r.ids)] = 1
    return ids, mask


def completion_topk(logits: torch.Tensor, rows: list[Row], k: int, offset: int = 0
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row, (values [n, k] float32, token ids [n, k] int32) of the k largest logits at its completion positions,
    largest first. logits [B, L, V] hold positions offset..offset+L-1 of the padded rows (a forward that kept only
    the last L positions), and every row's start must be at or after offset."""
    b = torch.cat([torch.full((r.n,), i, dtype=torch.long) for i, r in enumerate(rows)])
    t = torch.cat([torch.arange(r.start, r.start + r.n) for r in rows]) - offset
    values, ids = torch.topk(logits[b.to(logits.device), t.to(logits.device)], k, dim=-1)
    sizes = [r.n for r in rows]
    return list(zip(values.float().cpu().split(sizes), ids.to(torch.int32).cpu().split(sizes), strict=True))
