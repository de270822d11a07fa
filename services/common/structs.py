"""Free-form metadata (a JSON-like dict) to and from `google.protobuf.Struct`, the one way every service does it.

Struct numbers are doubles: an int put in comes back as a float (read such fields with int()).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2


def to_struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def from_struct(s: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(s)
