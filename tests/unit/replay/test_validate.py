"""Malformed trajectory messages are recognised, with a reason, without any network."""

from __future__ import annotations

import pytest

from groups import make_group
from services.replay.validate import Malformed, decode_group


def test_well_formed_group_decodes():
    group = make_group("g1", 3)
    assert decode_group(group.SerializeToString()) == group


def _without_id():
    g = make_group("g")
    g.group_id = ""
    return g


def _without_completions():
    g = make_group("g")
    del g.completions[:]
    return g


def _short_mask():
    g = make_group("g")
    g.completions[1].generated_mask.pop()
    return g


def _short_logprobs():
    g = make_group("g")
    g.completions[0].generation_logprobs.pop()
    return g


def _wrong_version_start():
    g = make_group("g", 2)
    g.completions[0].version_start = 1
    g.completions[0].version_end = 2
    return g


def _version_end_before_start():
    g = make_group("g", 2)
    g.completions[0].version_end = 1
    return g


def _flawed(flaws: list[int], prompt_token: bool = False):
    """A group whose first completion carries `flaws` (its first token not generated with prompt_token)."""
    def build():
        g = make_group("g")
        c = g.completions[0]
        c.generated_mask[0] = not prompt_token
        c.flaws[:] = flaws
        return g
    return build


@pytest.mark.parametrize("build, reason", [
    (_without_id, "empty group_id"),
    (_without_completions, "no completions"),
    (_short_mask, "lengths differ"),
    (_short_logprobs, "lengths differ"),
    (_wrong_version_start, "not the oldest"),
    (_version_end_before_start, "version_end"),
    (_flawed([1]), "flaws must be empty, or"),  # shorter than the tokens
    (_flawed([1, 0, 0, 0], prompt_token=True), "set only on generated tokens"),
    (_flawed([4, 0, 0, 0]), "TurnFlaw bits"),
])
def test_inconsistent_group_is_malformed_with_reason(build, reason):
    with pytest.raises(Malformed, match=reason):
        decode_group(build().SerializeToString())


def test_flaws_on_generated_tokens_decode():
    group = _flawed([0, 1, 3, 2], prompt_token=True)()
    assert decode_group(group.SerializeToString()).completions[0].flaws == [0, 1, 3, 2]


def test_garbage_bytes_are_malformed():
    with pytest.raises(Malformed):
        decode_group(b"\xff\xff\xff\xff not a protobuf")
