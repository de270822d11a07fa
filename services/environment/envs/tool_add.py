"""The "tool_add" environment: a calculator task with one tool, small enough for the tiny model.

The prompt "add 3 4" offers one tool, add(a, b). Turn 1: the model should call it; the environment runs the call
and answers with a role "tool" message holding the result ("7"), one per call. Turn 2: the model answers, and the
reward is 1.0 iff the answer (the reply's text, stripped) is the result of an earlier add call and that result is
the prompt's sum (metadata ground_truth). An answer with no tool call before it scores 0, so the task cannot be solved without the
tool. A call of another tool, or with arguments that are not two integers, gets an error message as its result.
Operands are drawn from 0..OPERANDS-1, so every sum is one digit. prompts() generates the data.
"""

from __future__ import annotations

import json
import random

from services.environment.base import Environment, StepResult, score_each

OPERANDS = 5
"""Prompts add two numbers drawn from 0 .. OPERANDS-1."""
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "the sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


class ToolAddEnvironment(Environment):
    kind = "tool_add"

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        def one(conversation, meta):
            last = conversation[-1] if conversation and conversation[-1].get("role") == "assistant" else {}
            if last.get("tool_calls"):
                results = [run_call(c) for c in last["tool_calls"]]
                good = [r["content"] for r in results if r["content"] == str(meta["ground_truth"])]
                state = {**meta, "tool_result": good[-1]} if good else meta
                return StepResult(observation="", messages=results, terminated=False, metadata=state)
            answer = str(last.get("content") or "").strip()
            correct = "tool_result" in meta and answer == str(meta["tool_result"])
            return StepResult(observation="Environment: correct" if correct else "Environment: incorrect",
                              reward=1.0 if correct else 0.0, answer=answer if return_extracted_answer else None)

        return score_each(one, conversations, metadata)

    def prompts(self, count: int, seed: int, offset: int) -> list[dict]:
        rows = []
        for index in range(offset, offset + count):
            rng = random.Random(f"tool_add:{seed}:{index}")
            a, b = rng.randrange(OPERANDS), rng.randrange(OPERANDS)
            rows.append({"messages": [{"role": "user", "content": f"add {a} {b}"}], "tools": [ADD_TOOL],
                         "metadata": {"ground_truth": str(a + b)}})
        return rows


def run_call(call: dict) -> dict:
    """The role "tool" message answering one OpenAI tool call."""
    function = call.get("function") or {}
    return {"role": "tool", "tool_call_id": call.get("id", ""), "name": function.get("name", ""),
            "content": _add(function) if function.get("name") == "add" else f"error: no tool {function.get('name')!r}"}


def _add(function: dict) -> str:
    try:
        args = json.loads(function.get("arguments") or "{}")
    except ValueError:
        return "error: arguments are not json"
    a, b = (args.get("a"), args.get("b")) if isinstance(args, dict) else (None, None)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
        return "error: add takes two integers a and b"
    return str(a + b)
