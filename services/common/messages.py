"""Chat messages and tool definitions between the proto and OpenAI's dict shape, the one way every service does it.

A message dict is OpenAI's: {"role", "content"} plus, where set, "tool_calls" (assistant: [{"id", "type":
"function", "function": {"name", "arguments": JSON text}}], and "reasoning" where a reasoning parser split it
off; "reasoning_content", its older name, is read too), "tool_call_id" and "name" (role "tool"). Unset
fields are left out, so a plain message stays {"role", "content"} as before tools existed. A tool definition
dict is an entry of OpenAI's `tools`: {"type": "function", "function": {"name", "description", "parameters"}};
its JSON Schema travels as text (FunctionDefinition.parameters_json), so its key order survives. Pure: no torch,
no network.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from services.common.errors import InvalidArgument, require
from services.common.pb.flywheel.v1 import types_pb2


def message_to_dict(m: types_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.reasoning:
        out["reasoning"] = m.reasoning
    return out


def message_from_dict(d: dict) -> types_pb2.ChatMessage:
    """OpenAI's message dict; content None (an assistant turn that only calls tools) becomes ""."""
    calls = [types_pb2.ToolCall(id=c.get("id") or "", type=c.get("type") or "function", function=types_pb2.FunctionCall(
        name=c["function"]["name"], arguments=arguments_text(c["function"].get("arguments"))))
        for c in d.get("tool_calls") or []]
    return types_pb2.ChatMessage(role=d["role"], content=d.get("content") or "", tool_calls=calls,
                                 tool_call_id=d.get("tool_call_id") or "", name=d.get("name") or "",
                                 reasoning=d.get("reasoning") or d.get("reasoning_content") or "")


def arguments_text(arguments: object) -> str:
    """OpenAI sends arguments as JSON text; some datasets write the object itself. Either way, text."""
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def tools_to_dicts(tools) -> list[dict]:
    """Repeated ToolDefinition -> OpenAI's `tools` list; InvalidArgument names a schema that is not a JSON object."""
    out = []
    for i, t in enumerate(tools):
        function: dict = {"name": t.function.name}
        if t.function.description:
            function["description"] = t.function.description
        if t.function.parameters_json:
            function["parameters"] = _schema(t.function.parameters_json, i)
        if t.function.strict:
            function["strict"] = True
        out.append({"type": t.type or "function", "function": function})
    return out


def _schema(text: str, i: int) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(f"tools[{i}].function.parameters_json is not JSON: {err}") from None
    require(isinstance(schema, dict), f"tools[{i}].function.parameters_json must be a JSON object (a JSON Schema)")
    return schema


def tool_from_dict(d: dict) -> types_pb2.ToolDefinition:
    """One OpenAI `tools` entry; json_format.ParseError names an unknown or mistyped field."""
    function = d.get("function")
    if not isinstance(function, dict):
        raise json_format.ParseError("a tool needs a function object: {type, function: {name, parameters}}")
    schema = function.get("parameters")
    text = {} if schema is None else {"parameters_json": json.dumps(schema, ensure_ascii=False)}
    body = {k: v for k, v in function.items() if k != "parameters"}
    return json_format.ParseDict({**d, "function": {**body, **text}}, types_pb2.ToolDefinition())


def dataset_row(row: dict) -> types_pb2.DatasetRow:
    """A row dict ({"messages", "metadata", "tools"}) as the proto; json_format.ParseError names a bad field."""
    out = json_format.ParseDict({k: v for k, v in row.items() if k != "tools"}, types_pb2.DatasetRow())
    out.tools.extend(tool_from_dict(t) for t in row.get("tools") or [])
    return out
