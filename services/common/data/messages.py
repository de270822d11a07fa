"""OpenAI chat messages as SFT, DPO and RM rows hold them, checked and put in one shape (pure).

A message is {"role", "content"} plus, where present, "tool_calls" (assistant), "tool_call_id" and
"name" (tool), "reasoning_content". The shape is what Hugging Face chat templates take:
    tool_calls: [{"id": str, "type": "function", "function": {"name": str, "arguments": {...}}}]
`arguments` becomes an object: OpenAI sends a JSON string, and vLLM parses it the same way before it
applies the chat template (vllm/renderers/chat_utils.py, _postprocess_messages), so a model trained on
these rows sees its tool calls as it saw them while generating. Keys whose value is null are dropped
first, because parquet (through `datasets`) fills every key any row has with null in every other row.
"""

from __future__ import annotations

import json

from services.common.data.rows import RowError

ROLES = ("system", "developer", "user", "assistant", "tool")
KEPT = ("tool_call_id", "name", "reasoning_content")
"""Optional message keys kept as they are (strings); any other key is dropped."""


def chat_messages(value: object, what: str) -> list[dict]:
    """`value` as a list of messages in the shape above; RowError names `what` and the message."""
    if not isinstance(value, list):
        raise RowError(f"{what} must be a list of messages, got {type(value).__name__}")
    return [_message(m, f"{what}[{i}]") for i, m in enumerate(value)]


def _message(m: object, what: str) -> dict:
    if not isinstance(m, dict):
        raise RowError(f"{what} must be an object, got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}
    role = m.get("role")
    if role not in ROLES:
        raise RowError(f"{what}.role must be one of {', '.join(ROLES)}, got {role!r}")
    out = {"role": role, "content": _text(m.get("content", ""), f"{what}.content")}
    calls = m.get("tool_calls") or []
    if calls and role != "assistant":
        raise RowError(f"{what}: only an assistant message carries tool_calls (role {role!r})")
    if calls:
        out["tool_calls"] = _tool_calls(calls, f"{what}.tool_calls")
    for key in KEPT:
        if key in m:
            if not isinstance(m[key], str):
                raise RowError(f"{what}.{key} must be text, got {type(m[key]).__name__}")
            out[key] = m[key]
    return out


def _text(content: object, what: str) -> str:
    """Text content, or a list of text parts ({"type": "text", "text": ...}) joined; nothing else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RowError(f"{what} must be text or a list of text parts (images and audio are not read here)")


def _tool_calls(calls: object, what: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RowError(f"{what} must be a list, got {type(calls).__name__}")
    return [_tool_call(c, f"{what}[{i}]") for i, c in enumerate(calls)]


def _tool_call(call: object, what: str) -> dict:
    if not isinstance(call, dict):
        raise RowError(f"{what} must be an object")
    fn = call.get("function", call)  # {"name", "arguments"} without the wrapper is read too
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowError(f"{what} has no function name")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), what)}}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    return out


def _arguments(args: object, what: str) -> dict:
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise RowError(f"{what}.function.arguments is not valid JSON: {err.msg}") from None
    if not isinstance(args, dict):
        raise RowError(f"{what}.function.arguments must be a JSON object, got {type(args).__name__}")
    return args


def says_something(m: dict) -> bool:
    """An assistant message with text or a tool call: a turn there is something to learn from."""
    return m["role"] == "assistant" and (bool(m["content"].strip()) or bool(m.get("tool_calls")))


def check_tools(value: object, what: str) -> list[dict] | None:
    """A row's tool definitions, passed to the chat template as they are; None when the row has none."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowError(f"{what} must be a list of tool objects")
    for i, tool in enumerate(value):
        fn = tool.get("function", tool)  # chat shape {"type", "function": {...}} or the flat Responses shape
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(f"{what}[{i}] has no name")
    return value
