"""Decode and check one trajectory message: pure, no IO.

A message that fails here is dead-lettered by ingest, never stored, so everything the
trainer gets from replay has a group id, completions, and aligned per-token arrays.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from services.common.config import RewardScalingConfig
from services.common.pb.flywheel.v1 import types_pb2
from services.common.rewards import scale_reward


FLAW_BITS = sum(types_pb2.TurnFlaw.values())
"""Every TurnFlaw bit; Completion.flaws holds no other."""


class Malformed(ValueError):
    """The message cannot be stored; str(err) is the short reason sent with the dead letter."""


def decode_group(data: bytes) -> types_pb2.TrajectoryGroup:
    """Bytes from the trajectory stream -> a TrajectoryGroup, or raise Malformed(reason)."""
    try:
        group = types_pb2.TrajectoryGroup.FromString(data)
    except DecodeError as err:
        raise Malformed(f"undecodable: {err}") from None
    check_group(group)
    return group


def check_group(group: types_pb2.TrajectoryGroup) -> None:
    """Raise Malformed unless the group is complete and self-consistent."""
    if not group.group_id:
        raise Malformed("empty group_id")
    if not group.completions:
        raise Malformed("no completions")
    if group.version_start < 0:
        raise Malformed(f"negative version_start {group.version_start}")
    for i, c in enumerate(group.completions):
        n = len(c.token_ids)
        if len(c.generated_mask) != n or len(c.generation_logprobs) != n:
            raise Malformed(f"completion {i}: lengths differ: token_ids {n}, generated_mask "
                            f"{len(c.generated_mask)}, generation_logprobs {len(c.generation_logprobs)}")
        if c.flaws and (len(c.flaws) != n or any(f and not g for f, g in zip(c.flaws, c.generated_mask))
                        or any(f & ~FLAW_BITS for f in c.flaws)):
            raise Malformed(f"completion {i}: flaws must be empty, or TurnFlaw bits per token set only on "
                            f"generated tokens ({len(c.flaws)} for {n} tokens)")
        if c.version_end < c.version_start:
            raise Malformed(f"completion {i}: version_end {c.version_end} < version_start {c.version_start}")
    oldest = min(c.version_start for c in group.completions)
    # Staleness is measured from this field; a wrong value would let stale data through.
    if group.version_start != oldest:
        raise Malformed(f"version_start {group.version_start} is not the oldest completion version {oldest}")


def zero_variance(group: types_pb2.TrajectoryGroup, scaling: RewardScalingConfig | None = None) -> bool:
    """All completions scored alike once scaled (grpo.reward_scaling clamps, so rewards past its source range
    become equal): GRPO's advantages are all zero, so DAPO's dynamic sampling drops the group."""
    return len({scale_reward(c.reward, scaling) if scaling else c.reward for c in group.completions}) <= 1
