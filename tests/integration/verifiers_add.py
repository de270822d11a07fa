"""What the tests of environment/verifiers_add_env.py share: its prompt, the tool verifiers offers for it, its
reward rule checked independently, and a briefly supervised start of the tiny model on that prompt
(tests/tool_demos.py), right on RIGHT_FRACTION of its demonstrations."""

from __future__ import annotations

import random
import re
from pathlib import Path

from tool_demos import direct_answer, supervise

ENV_DIR = Path(__file__).parent / "environment"  # verifiers_add_env.py
SEQ = 256
TOOL = {"type": "function", "function": {  # what verifiers' chat program offers for verifiers_add_env's MCP tool
    "name": "add_toolset_add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"title": "A", "type": "integer"},
                                                    "b": {"title": "B", "type": "integer"}},
                   "required": ["a", "b"], "title": "addArguments"}}}
RIGHT_FRACTION = 0.5
"""Of the supervised start's demonstrations, those that answer the sum; the others answer the first operand."""


def ask(a: int) -> str:
    return f"what is {a} + {a + 2}? use the add tool."  # verifiers_add_env's prompt for row a


def rule(reply: str, a: int, b: int) -> float:
    """The rubric's reward, written again: the reply's last number is a + b."""
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


def supervised_start(out: Path, tasks: int) -> Path:
    """The tiny model after 300 supervised steps on rows 0..tasks-1, saved in `out`."""
    def demo(tok, rng: random.Random):
        a = rng.randrange(tasks)
        return direct_answer(tok, ask(a), TOOL, str(2 * a + 2) if rng.random() < RIGHT_FRACTION else str(a))

    return supervise(out, demo, steps=300, overrides=[f"policy.max_total_sequence_length={SEQ}"], threads=1)
