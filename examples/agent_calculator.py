"""A complete agent on Flywheel's endpoint: the OpenAI SDK, a calculator tool, a few turns (docs/agents.md).

The rollout worker hands the agent OPENAI_BASE_URL (it names the episode) and OPENAI_API_KEY (the episode's
token); the SDK reads both.
Run: OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agent_calculator.py "add 2 3"
"""

import json
import sys

from openai import OpenAI

EXPRESSION = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate + - * / on numbers",
                                           "parameters": EXPRESSION}}]


def calculate(expression: str) -> str:
    if not set(expression) <= set("0123456789+-*/(). "):
        return "error: numbers and + - * / only"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators only
    except Exception as err:  # noqa: BLE001 - the model reads the error and may try again
        return f"error: {err}"


def main(task: str, turns: int = 3) -> list[dict]:
    client = OpenAI()
    messages = [{"role": "user", "content": task}]
    for _ in range(turns):
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        reply = answer.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            args = json.loads(call.function.arguments or "{}")
            result = calculate(str(args.get("expression")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not reply.tool_calls:
            messages.append({"role": "user", "content": "check it and answer again"})
    return messages


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "add 2 3")))
