"""Responses input items to chat messages, as NeMo Gym's VLLMConverter maps them (responses_converter.py)."""

from __future__ import annotations

import pytest

from services.rollout.endpoint.errors import ApiError
from services.rollout.endpoint.responses import messages, output_items
from services.rollout.endpoint.schemas import ResponsesRequest


def test_items_become_the_chat_messages_nemo_gym_makes():
    req = ResponsesRequest(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "add "}, {"type": "input_text", "text": "2 3"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "use the tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"e": "2+3"}',
         "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "5", "annotations": []}]},
        {"role": "user", "content": "thanks"}])
    assert messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": "<think>use the tool</think>", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "thanks"}]


def test_a_string_input_is_one_user_message():
    assert messages(ResponsesRequest(input="hi")) == [{"role": "user", "content": "hi"}]


def test_an_item_without_a_chat_form_is_a_400():
    with pytest.raises(ApiError) as err:
        messages(ResponsesRequest(input=[{"type": "web_search_call", "id": "w"}]))
    assert err.value.status == 400 and "web_search_call" in err.value.message


def test_an_answer_with_tool_calls_and_no_text_is_function_call_items_only():
    items = output_items({"content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]})
    assert [(i["type"], i["call_id"], i["name"]) for i in items] == [("function_call", "c2", "calc")]
    [message] = output_items({"content": "", "tool_calls": None})
    assert message["type"] == "message" and message["content"][0]["text"] == ""
