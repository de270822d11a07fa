"""The fuzzer's oracle (contract.py: what the proto says a storable TrajectoryGroup is) against replay's own check
(services/replay/validate.py): on every payload the fuzzer could send, and on near-valid groups that break one rule
at a time, the two must agree. Either being wrong shows as a disagreement; the fuzz test then counts replay's dead
letters against the contract, not against replay's own decode."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import contract
from fuzzing import malformed, messages
from services.common.pb.flywheel.v1 import types_pb2
from services.replay.validate import Malformed, decode_group

TG = types_pb2.TrajectoryGroup


def _replay_refuses(payload: bytes) -> bool:
    try:
        decode_group(payload)
    except Malformed:
        return True
    return False


@st.composite
def near_valid(draw) -> bytes:
    """Groups that are valid but for a few small slips: off-by-one lengths, a missing id, versions out of order."""
    def completion():
        n = draw(st.integers(0, 3))
        slip = st.sampled_from([0, 0, 0, 1, -1])
        start = draw(st.integers(-1, 3))
        return types_pb2.Completion(token_ids=[7] * n, generated_mask=[True] * max(0, n + draw(slip)),
                                    generation_logprobs=[-0.5] * max(0, n + draw(slip)), version_start=start,
                                    version_end=start + draw(st.sampled_from([0, 0, 1, -1])))
    completions = [completion() for _ in range(draw(st.integers(0, 3)))]
    oldest = min((c.version_start for c in completions), default=0)
    version = oldest + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return TG(group_id=draw(st.sampled_from(["g", "g", ""])), completions=completions,
              version_start=version).SerializeToString()


def test_the_contract_reads_the_per_token_fields_from_the_proto():
    assert contract.per_token_fields() == ("generated_mask", "generation_logprobs")


def test_a_well_formed_group_is_storable_and_each_broken_rule_is_named():
    good = TG(group_id="g", version_start=1, completions=[types_pb2.Completion(
        token_ids=[1, 2], generated_mask=[True, True], generation_logprobs=[-1.0, -1.0], version_start=1,
        version_end=2)])
    assert contract.violations(good.SerializeToString()) == []
    broken = {"no group_id": dict(group_id=""), "no completions": dict(completions=[]),
              "not the oldest": dict(version_start=0)}
    for reason, change in broken.items():
        bad = TG(); bad.CopyFrom(good)
        for field, value in change.items():
            bad.ClearField(field)
            if value:
                setattr(bad, field, value)
        assert any(reason in v for v in contract.violations(bad.SerializeToString())), reason
    short = TG(); short.CopyFrom(good)
    del short.completions[0].generation_logprobs[1]
    assert contract.violations(short.SerializeToString()) == ["completion 0: generation_logprobs is not per token"]
    assert contract.violations(b"\xff\xff\xff") and contract.violations(b"\x0a")


@settings(max_examples=400, deadline=None)
@given(payload=st.one_of(near_valid(), malformed(TG.DESCRIPTOR, messages(TG.DESCRIPTOR))))
def test_the_contract_and_replays_check_agree(payload):
    assert bool(contract.violations(payload)) == _replay_refuses(payload), contract.violations(payload)
