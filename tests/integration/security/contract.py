"""What the proto says a storable TrajectoryGroup is, read from the proto itself: the fuzzer's oracle for which
payloads replay must dead-letter, independent of replay's own `decode_group` (services/replay/validate.py).

From the descriptor: the message parses, and the fields of Completion whose comment in
proto/flywheel/v1/types.proto begins "Per token in token_ids" are as long as token_ids. From the comments of
TrajectoryGroup: it is stored under `group_id` (so one is needed), holds "G completions" (G >= 1), and its
`version_start` is the "Oldest version_start of the completions". Versions count optimizer steps (>= 0), and a
completion's `version_end` is the version "when the last token was sampled", never before its first token's.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from google.protobuf.message import DecodeError

from services.common.pb.flywheel.v1 import types_pb2

PROTO = Path(__file__).resolve().parents[3] / "proto" / "flywheel" / "v1" / "types.proto"


@cache
def per_token_fields() -> tuple[str, ...]:
    """Completion's fields documented as one value per token of token_ids, checked against the descriptor."""
    body = re.search(r"^message Completion \{(.*?)^\}", PROTO.read_text(), re.S | re.M).group(1)
    names = tuple(re.findall(r"// Per token in token_ids[^\n]*\n\s*repeated \w+ (\w+) = \d+;", body))
    fields = types_pb2.Completion.DESCRIPTOR.fields_by_name
    assert names and all(fields[n].is_repeated for n in names), names
    return names


def violations(payload: bytes) -> list[str]:
    """Why the proto's contract refuses `payload` as a TrajectoryGroup; empty when it is storable."""
    try:
        group = types_pb2.TrajectoryGroup.FromString(payload)
    except DecodeError as err:
        return [f"does not parse: {err}"]
    out = [] if group.group_id else ["no group_id"]
    if not group.completions:
        return out + ["no completions"]
    for i, c in enumerate(group.completions):
        out += [f"completion {i}: {name} is not per token" for name in per_token_fields()
                if len(getattr(c, name)) != len(c.token_ids)]
        if c.version_end < c.version_start:
            out.append(f"completion {i}: last token sampled before the first")
    oldest = min(c.version_start for c in group.completions)
    if group.version_start != oldest or oldest < 0:
        out.append(f"version_start {group.version_start} is not the oldest completion version {oldest} (>= 0)")
    return out
