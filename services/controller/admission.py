"""The admission rule of bounded-staleness async GRPO (pure arithmetic, no IO).

Target step t may be leased only while the rollout fleet serves version >= t - k. Since a
group leased for t is generated at a version >= t - k, and step t consumes it, its
staleness t - version_start is at most k unless a failure delays it. At most
(k + 1) * prompts_per_step groups are leased and not yet consumed. With k = 0 the batch
for step v waits for weights v: synchronous on-policy GRPO.
"""

from __future__ import annotations


def leasable_targets(next_target: int, loaded_version: int, max_staleness: int, max_num_steps: int) -> range:
    """Targets that may be leased now, in order. loaded_version < 0 means no weights anywhere yet."""
    if loaded_version < 0:
        return range(next_target, next_target)
    return range(next_target, min(max_num_steps, loaded_version + max_staleness + 1))
