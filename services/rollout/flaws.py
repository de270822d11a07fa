"""Flawed assistant turns, judged as NeMo RL's NeMo Gym bridge judges them (its environments/nemo_gym.py, read at
7ea279a): pure, no IO.

A turn is judged by the last part of its reply, in the order NeMo Gym's model server lays a reply out (reasoning,
then the text, then the tool calls):

    tool calls       -> sound: the tool parser read them
    text             -> a tool-call pattern in it: an invalid tool call (markup the parser could not read, which no
                        agent executes); any thinking tag in it: malformed thinking (reasoning left in the answer)
    reasoning only   -> a tool-call pattern in it: an invalid tool call; one thinking tag written more than once:
                        malformed thinking (a single pair is expected)

The flags ride on the turn's tokens (Completion.flaws); the trainer overwrites those tokens' advantages with
grpo.invalid_tool_call_advantage / malformed_thinking_advantage (services/trainer/algorithms/flaws.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.flywheel.v1 import types_pb2

INVALID_TOOL_CALL = types_pb2.TURN_FLAW_INVALID_TOOL_CALL
MALFORMED_THINKING = types_pb2.TURN_FLAW_MALFORMED_THINKING


def turn_flaws(content: str | None, reasoning: str | None, tool_calls: list, *, patterns: Sequence[str],
               tags: Sequence[str]) -> int:
    """TurnFlaw bits of one reply: its text after the reasoning parser and the tool parser took their parts."""
    if tool_calls:
        return 0
    if content:
        return (INVALID_TOOL_CALL * any(p in content for p in patterns)
                | MALFORMED_THINKING * any(t in content for t in tags))
    if reasoning:
        return (INVALID_TOOL_CALL * any(p in reasoning for p in patterns)
                | MALFORMED_THINKING * any(reasoning.count(t) > 1 for t in tags))
    return 0
