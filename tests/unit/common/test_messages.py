"""OpenAI-format messages with tool calls and tool definitions survive the proto, as every service sends them."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from services.common.errors import InvalidArgument
from services.common.messages import dataset_row, message_from_dict, message_to_dict, tool_from_dict, tools_to_dicts
from services.common.pb.flywheel.v1 import environment_pb2, types_pb2
from services.common.data.rows import RowError, Templates, to_row

# As OpenAI's chat API writes an episode with one call: content null beside tool_calls, arguments as JSON text.
EPISODE = [
    {"role": "system", "content": "use the tools"},
    {"role": "user", "content": "add 3 4"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "7"},
    {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "2"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def test_tool_calls_and_tool_results_round_trip_through_the_wire():
    sent = environment_pb2.Episode(messages=[message_from_dict(m) for m in EPISODE])
    got = [message_to_dict(m) for m in environment_pb2.Episode.FromString(sent.SerializeToString()).messages]
    expected = [{**m, "content": m["content"] or ""} for m in EPISODE]  # null content travels as ""
    assert got == expected


def test_a_plain_message_stays_role_and_content():
    assert message_to_dict(message_from_dict({"role": "user", "content": "hi"})) == {"role": "user", "content": "hi"}


def test_an_assistants_reasoning_travels_under_its_current_name():
    for name in ("reasoning", "reasoning_content"):
        sent = message_from_dict({"role": "assistant", "content": "5", name: "2+3"})
        got = message_to_dict(types_pb2.ChatMessage.FromString(sent.SerializeToString()))
        assert got == {"role": "assistant", "content": "5", "reasoning": "2+3"}


def test_arguments_written_as_an_object_travel_as_json_text():
    m = message_from_dict({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 3}}}]})
    assert m.tool_calls[0].function.arguments == '{"a": 3}'


def test_tool_definitions_round_trip_with_their_json_schema():
    group = types_pb2.PromptGroup(tools=[tool_from_dict(t) for t in TOOLS])
    back = tools_to_dicts(types_pb2.PromptGroup.FromString(group.SerializeToString()).tools)
    assert back == TOOLS


def test_a_schemas_key_order_survives_the_wire():
    """Chat templates render the schema in its own order: b before a must stay b before a."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {k: {"type": "integer"} for k in "zyxbaq"}}}}
    back = tools_to_dicts(types_pb2.PromptGroup.FromString(
        types_pb2.PromptGroup(tools=[tool_from_dict(tool)]).SerializeToString()).tools)
    assert list(back[0]["function"]["parameters"]["properties"]) == list("zyxbaq")


def test_an_unknown_field_in_a_tool_definition_is_refused():
    with pytest.raises(json_format.ParseError, match="parameterz"):
        tool_from_dict({"type": "function", "function": {"name": "add", "parameterz": {}}})


def test_an_openai_format_dataset_row_keeps_its_tools_and_tool_turns():
    record = {"messages": [*EPISODE, {"role": "assistant", "content": "7 and 2"}], "tools": TOOLS}
    row = types_pb2.DatasetRow.FromString(dataset_row(to_row(record, None, None, Templates())).SerializeToString())
    assert [message_to_dict(m) for m in row.messages] == [
        {k: v for k, v in m.items() if v is not None} | {"content": m["content"] or ""} for m in EPISODE]
    assert tools_to_dicts(row.tools) == TOOLS
    assert row.metadata["ground_truth"] == "7 and 2"  # the trailing plain answer, as before tools


@pytest.mark.parametrize("record, match", [
    ({"messages": [{"role": "user", "content": None}]}, "text content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"add": {}}}, "tools must be a list"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, "a tool call must be"),
])
def test_malformed_tool_columns_are_refused_with_the_reason(record, match):
    with pytest.raises(RowError, match=match):
        to_row(record, None, None, Templates())


@pytest.mark.parametrize("schema, why", [("{not json", "is not JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_tool_schema_that_is_not_a_json_object_is_invalid_argument(schema, why):
    tool = types_pb2.ToolDefinition(function=types_pb2.FunctionDefinition(name="add", parameters_json=schema))
    with pytest.raises(InvalidArgument, match=rf"tools\[1\].function.parameters_json {why}"):
        tools_to_dicts([types_pb2.ToolDefinition(function=types_pb2.FunctionDefinition(name="ok")), tool])
