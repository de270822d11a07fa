"""Tool calls read by vLLM's own parsers, and the tiny chat template with tools, tool calls and tool results."""

from __future__ import annotations

import json
import sys

import pytest

from services.common.config import ConfigError, load_config
from services.common.modeling import build_tiny_tokenizer
from services.rollout.tools import load_parser, observation_text, parse_tool_calls, render

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_hermes_reads_a_tool_call_and_the_text_before_it(tok):
    content, calls = parse_tool_calls("let me add. " + CALL, parser="hermes", tokenizer=tok, tools=[ADD])
    assert content == "let me add. "
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}


def test_hermes_reads_two_calls_with_distinct_ids(tok):
    _, calls = parse_tool_calls(CALL + CALL.replace("3", "5"), parser="hermes", tokenizer=tok, tools=[ADD])
    assert [json.loads(c["function"]["arguments"])["a"] for c in calls] == [3, 5]
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", ["7", "the sum is 7", '<tool_call>{"name": "add", "arguments": {"a": 3,'])
def test_text_without_a_readable_call_is_content_with_no_calls(tok, text):
    assert parse_tool_calls(text, parser="hermes", tokenizer=tok, tools=[ADD]) == (text, [])


def test_no_parser_leaves_a_call_as_text(tok):
    assert parse_tool_calls(CALL, parser=None, tokenizer=tok, tools=[ADD]) == (CALL, [])


def test_an_unknown_parser_is_refused_with_vllms_names(tok):
    with pytest.raises(ValueError, match="hermes"):
        load_parser("no_such_parser", tok)


def test_a_tool_parser_is_refused_at_config_time_without_vllm(monkeypatch):
    cfg = load_config(None, ["policy.generation.tool_parser=hermes"])
    cfg.policy.generation.check_parsers()  # installed here: accepted
    monkeypatch.setitem(sys.modules, "vllm", None)  # what importlib reports for a package that is not there
    with pytest.raises(ConfigError, match="vllm package is not installed"):
        cfg.policy.generation.check_parsers()
    load_config(None).policy.generation.check_parsers()  # no tool_parser: nothing to refuse


def test_the_tiny_template_renders_tools_calls_and_results(tok):
    prompt = [{"role": "user", "content": "add 3 4"}]
    assert render(tok, prompt, [ADD], add_generation_prompt=True) == "<bos>tools: add(a,b)\nu:add 3 4\na:"
    assert render(tok, prompt, None, add_generation_prompt=True) == "<bos>u:add 3 4\na:"
    called = prompt + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}]
    assert render(tok, called, [ADD], add_generation_prompt=False).endswith("a:" + CALL + "\n")
    result = [{"role": "tool", "content": "7", "tool_call_id": "c1", "name": "add"}]
    assert observation_text(tok, called, result, [ADD]) == "t:7\na:"


def test_the_call_the_template_renders_is_the_call_hermes_reads_back(tok):
    called = [{"role": "user", "content": "add 3 4"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}]
    text = render(tok, called, [ADD], add_generation_prompt=False).split("a:", 1)[1].rstrip("\n")
    _, calls = parse_tool_calls(text, parser="hermes", tokenizer=tok, tools=[ADD])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 3, "b": 4})]
    assert tok.unk_token_id not in tok(text, add_special_tokens=False).input_ids  # every character is in the vocabulary
