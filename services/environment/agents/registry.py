"""Agent kinds by name: the `type` of an agent spec picks the class that runs its episodes.

An agent environment's spec is a JSON object, `{"type": "program", ...that type's fields}` (the config's
`environments[].agent`, or EnvironmentSpec.agent over gRPC). A new kind is a module with an `Agent` subclass
whose constructor takes the spec's other fields as keyword arguments and raises `ValueError` for bad ones, and
one line in `KINDS`. Modules are imported only when their kind is used, so a kind whose package is missing
costs nothing to the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from services.environment.agents import Agent

KINDS: dict[str, str] = {
    "program": "services.environment.agents.program:ProgramAgent",
    "verifiers": "services.environment.agents.verifiers_agent:VerifiersAgent",
    "nemo_gym": "services.environment.agents.nemo_gym:NemoGymAgent",
}
"""Agent type -> "module:Class"."""


class UnknownAgent(ValueError):
    """A spec with no type, an unknown type, or fields its type refuses."""


def make_agent(spec: dict[str, Any]) -> Agent:
    """The agent a spec describes; UnknownAgent naming the problem otherwise."""
    fields = dict(spec)
    kind = fields.pop("type", None)
    if kind not in KINDS:
        raise UnknownAgent(f"agent.type must be one of {sorted(KINDS)}, got {kind!r}")
    module, name = KINDS[kind].split(":")
    cls = getattr(importlib.import_module(module), name)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as err:  # TypeError: a field the class does not take
        raise UnknownAgent(f"agent {kind!r}: {err}") from None
