"""A work item reaches rollout through the work queue, which need not hold only what the controller leased:
rollout runs one only if it asks for what a valid environment spec may (services/common/work.py)."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.main import check_group

CFG = load_config()


def group(**fields) -> types_pb2.PromptGroup:
    return types_pb2.PromptGroup(group_id="g", num_generations=2, messages=[types_pb2.ChatMessage(content="q")],
                                 **fields)


def test_a_leased_group_passes():
    check_group(group(max_turns=3, reward_scale=0.5, sampling=types_pb2.SamplingParams(temperature=0.7)), CFG)


@pytest.mark.parametrize("fields, message", [
    ({"reward_scale": float("nan")}, "reward_scale must be >= 0"),  # every reward NaN, then the weights
    ({"reward_scale": float("inf")}, "reward_scale must be >= 0"),
    ({"max_turns": 10**6}, "max_turns must be in 0..1000"),
    ({"sampling": types_pb2.SamplingParams(temperature=1e-7)}, "sampling.temperature must be 0"),
    ({"sampling": types_pb2.SamplingParams(top_p=float("nan"))}, "sampling.top_p must be in"),
    ({"num_generations": 10**9}, "num_generations must be in"),
])
def test_a_group_no_valid_spec_could_lease_is_refused(fields, message):
    g = group()
    for name, value in fields.items():
        if name == "sampling":
            g.sampling.CopyFrom(value)
        else:
            setattr(g, name, value)
    with pytest.raises(InvalidArgument, match=message):
        check_group(g, CFG)
