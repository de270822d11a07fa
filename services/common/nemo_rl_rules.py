"""The pieces NeMo RL's key rules are made of: a dotted lookup, the Rule record and its common predicates.

nemo_rl.py (the general table) and nemo_rl_megatron.py (policy.megatron_cfg) both build their rules
from these, so each table reads as data: pattern, when the value is accepted, why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MISSING = object()


def get(tree: dict, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    """Dotted key; `*` matches one level."""
    accept: Callable[[Any, dict], bool]
    """(value, whole tree) -> whether the value asks for nothing Flywheel does differently."""
    why: str


def is_(expected: Any) -> Callable[[Any, dict], bool]:
    return lambda v, _: v == expected


def off(v: Any, _: dict) -> bool:
    return not v or (isinstance(v, dict) and not v.get("enabled", False))


def any_(v: Any, _: dict) -> bool:
    return True


def same_as(other: str) -> Callable[[Any, dict], bool]:
    return lambda v, tree: v == get(tree, other)


def when(other: str, expected: Any) -> Callable[[Any, dict], bool]:
    return lambda v, tree: get(tree, other, expected) == expected
