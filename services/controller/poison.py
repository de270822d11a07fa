"""Poisoned groups: the run's count of them, and the rule that stops the run.

    rollout: a group failed its rollout.max_group_failures-th delivery, not for an outage ──PoisonedGroup──▶
    controller: counted (saved with the run state) ──▶ count <= rollout.max_poisoned_groups: a NEW prompt leased
                                                                                            in its place
                                                   └─▶ one more: the run stops (RunFailed), naming the last error

A poisoned prompt is not leased again in its place: it would fail the same way. It comes back only with its
dataset's next epoch, where it is poisoned (and counted) again. The rule is a count, not a fraction, so that a
run whose every group fails (a template that refuses every conversation) stops after a few groups, whatever its
size; a dataset with more bad rows than the bound needs cleaning, or a larger bound (docs/reliability.md).

An announcement counts only for a group the controller leased and has not replaced yet (main.py): a worker's
repeated announcement, or a stray publisher's, neither counts nor stops the run. So neither does a group poisoned
after its lease was forgotten (its step trained long before, from other groups).
"""

from __future__ import annotations

from services.common.config import RolloutConfig
from services.common.pb.flywheel.v1 import types_pb2


def describe(p: types_pb2.PoisonedGroup) -> str:
    """One line for the log and the console."""
    return (f"poisoned group {p.group_id[:12]} (prompt {p.prompt_id}, env {p.env_name}) after {p.deliveries} "
            f"deliveries: {p.error}")


def run_failure(poisoned: int, cfg: RolloutConfig, last: types_pb2.PoisonedGroup) -> str:
    """Why the run stops once `poisoned` groups are poisoned; "" while it goes on."""
    if poisoned <= cfg.max_poisoned_groups:
        return ""
    return (f"{poisoned} prompt groups were poisoned (each failed on delivery rollout.max_group_failures="
            f"{cfg.max_group_failures} or later, not for an outage), more than rollout.max_poisoned_groups="
            f"{cfg.max_poisoned_groups}; the last, prompt {last.prompt_id!r}, failed with: {last.error}")
