"""How per-micro-batch loss metrics combine into one step's metrics (pure).

The loss divides every mean-like metric by the step's GLOBAL valid tokens or sequences, so
those add up across micro-batches and ranks. Extremes do not: a probs_ratio_min of 0.93 in
two micro-batches is 0.93 for the step, not 1.86. Keys ending in `_min` combine by min and
keys ending in `_max` by max, as NeMo RL's driver does.
"""

from __future__ import annotations

from typing import Literal

Reduction = Literal["sum", "min", "max"]


def reduction(name: str) -> Reduction:
    """How metric `name` combines across micro-batches and data-parallel ranks."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum"


def combine_metrics(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """total ⊕ part, key by key; a key only in one side is taken as is. Returns a new dict."""
    out = dict(total)
    for name, value in part.items():
        if name not in out:
            out[name] = value
            continue
        how = reduction(name)
        out[name] = min(out[name], value) if how == "min" else max(out[name], value) if how == "max" \
            else out[name] + value
    return out
