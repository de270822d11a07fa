"""Step metrics combined over micro-batches equal the metrics of the whole batch in one piece.

Mean-like metrics are divided by global counts, so they add up; _min/_max are extremes and
must combine by min/max (two micro-batches once reported probs_ratio_min 0.93 as 1.86).
"""

import pytest
import torch

from services.common.config import LossConfig
from services.trainer.algorithms import LossInputs, clipped_pg_loss
from services.trainer.algorithms.metrics import combine_metrics, reduction

BATCH, LENGTH = 6, 5


def batch() -> tuple[torch.Tensor, LossInputs]:
    g = torch.Generator().manual_seed(3)
    prev = -torch.rand(BATCH, LENGTH, generator=g, dtype=torch.float64) * 2
    data = LossInputs(prev_logprobs=prev,
                      generation_logprobs=prev + 0.1 * torch.randn(BATCH, LENGTH, generator=g, dtype=torch.float64),
                      advantages=torch.randn(BATCH, generator=g, dtype=torch.float64),
                      token_mask=torch.rand(BATCH, LENGTH, generator=g) < 0.8,
                      sample_mask=torch.ones(BATCH, dtype=torch.bool))
    curr = prev + 0.3 * torch.randn(BATCH, LENGTH, generator=g, dtype=torch.float64)
    return curr, data


def part(data: LossInputs, rows: slice) -> LossInputs:
    return LossInputs(**{f: (getattr(data, f)[rows] if getattr(data, f) is not None else None)
                         for f in LossInputs.__slots__})


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_metrics_over_micro_batches_equal_the_whole_batch_metrics(micro_batches):
    cfg = LossConfig(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    curr, data = batch()
    mask = data.token_mask & data.sample_mask[:, None]
    totals = dict(global_valid_tokens=float(mask.sum()), global_valid_seqs=float(data.sample_mask.sum()))
    _, whole = clipped_pg_loss(curr, data, cfg, **totals)
    combined: dict[str, float] = {}
    size = BATCH // micro_batches
    for start in range(0, BATCH, size):
        rows = slice(start, start + size)
        _, metrics = clipped_pg_loss(curr[rows], part(data, rows), cfg, **totals)
        combined = combine_metrics(combined, metrics)
    assert {"probs_ratio_min", "probs_ratio_max", "sampling_importance_ratio_max"} <= whole.keys()
    assert whole["probs_ratio_min"] < 1 < whole["probs_ratio_max"]
    for name, value in whole.items():
        assert combined[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_reduction_is_by_suffix():
    assert [reduction(n) for n in ("probs_ratio_min", "sampling_importance_ratio_max", "loss")] == \
        ["min", "max", "sum"]
    assert combine_metrics({"a_min": 0.93, "a_max": 1.1, "loss": 1.0},
                           {"a_min": 0.95, "a_max": 1.05, "loss": 2.0}) == {"a_min": 0.93, "a_max": 1.1, "loss": 3.0}
