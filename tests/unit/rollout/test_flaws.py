"""Which replies the endpoint flags, case by case as NeMo RL's NeMo Gym bridge judges a turn's last output item
(its `_detect_invalid_tool_call_and_malformed_thinking`, read at 7ea279a), and the reasoning parser that splits a
reply first (vLLM's, on a tokenizer that has the thinking tags)."""

from __future__ import annotations

import pytest

from services.common.config import GenerationConfig
from services.common.modeling import build_tiny_tokenizer
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.flaws import turn_flaws
from services.rollout.tools import load_reasoning_parser, split_reasoning
from services.trainer.algorithms import flaws as trainer_flaws

DEFAULTS = GenerationConfig()
INVALID, MALFORMED = 1, 2
CALL = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]


@pytest.mark.parametrize("content, reasoning, calls, flaws", [
    ("7", None, [], 0),
    ('<tool_call>{"name": "add"', None, [], INVALID),  # markup the parser could not read
    ("</function_call>", "fine", [], INVALID),
    ("<think>x</think>7", None, [], MALFORMED),  # reasoning left in the answer
    ("</think>", None, [], MALFORMED),
    ("<tool_call><think>", None, [], INVALID | MALFORMED),
    ("<think>", "<think><think>", CALL, 0),  # the parser read a call: the turn's last item is the call
    (None, "plan <tool_call>", [], INVALID),  # reasoning only: judged on the reasoning
    ("", "a <think> b", [], 0),  # one tag in reasoning is expected
    (None, "a <think> b <think>", [], MALFORMED),  # repeated
    (None, None, [], 0),
])
def test_a_reply_is_flagged_as_nemo_rls_bridge_flags_its_last_item(content, reasoning, calls, flaws):
    got = turn_flaws(content, reasoning, calls, patterns=DEFAULTS.invalid_tool_call_patterns,
                     tags=DEFAULTS.thinking_tags)
    assert got == flaws


def test_configured_markers_replace_the_defaults():
    assert turn_flaws("[TOOL]", None, [], patterns=["[TOOL]"], tags=["<t>"]) == INVALID
    assert turn_flaws("<tool_call>", None, [], patterns=["[TOOL]"], tags=["<t>"]) == 0


def test_the_bits_are_the_protos():
    """The trainer's constants (it imports no proto) against the descriptors."""
    assert types_pb2.TURN_FLAW_INVALID_TOOL_CALL == trainer_flaws.INVALID_TOOL_CALL == INVALID
    assert types_pb2.TURN_FLAW_MALFORMED_THINKING == trainer_flaws.MALFORMED_THINKING == MALFORMED


@pytest.fixture(scope="module")
def thinking_tokenizer():
    """The tiny tokenizer with Qwen3's thinking tags as tokens, as a thinking model's vocabulary has them."""
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>add 2 3</think>5", "add 2 3", "5"),
    ("add 2 3</think>5", "add 2 3", "5"),  # a template that opens the tag in the prompt
    ("<think>still thinking", "still thinking", None),  # cut off inside the reasoning
    ("<think>x</think>", "x", None),
])
def test_vllms_deepseek_r1_parser_splits_the_reasoning_off(thinking_tokenizer, text, reasoning, content):
    assert split_reasoning(text, parser="deepseek_r1", tokenizer=thinking_tokenizer) == (reasoning, content)
    assert split_reasoning(text, parser=None, tokenizer=thinking_tokenizer) == (None, text)


def test_a_parser_that_is_not_vllms_or_cannot_read_the_tokenizer_is_refused_at_start(thinking_tokenizer):
    load_reasoning_parser("deepseek_r1", thinking_tokenizer)
    with pytest.raises(ValueError, match="not one of vLLM's reasoning parsers: .*deepseek_r1"):
        load_reasoning_parser("no_such_parser", thinking_tokenizer)
    with pytest.raises(ValueError, match="cannot read this tokenizer"):
        load_reasoning_parser("deepseek_r1", build_tiny_tokenizer())  # no thinking tags in its vocabulary


def test_a_parser_that_reads_the_requests_template_kwargs_gets_them(thinking_tokenizer):
    """vLLM builds deepseek_v3's parser per request: it splits only when the request turned thinking on."""
    text = "<think>x</think>y"
    assert split_reasoning(text, parser="deepseek_v3", tokenizer=thinking_tokenizer) == (None, text)
    assert split_reasoning(text, parser="deepseek_v3", tokenizer=thinking_tokenizer,
                           chat_template_kwargs={"thinking": True}) == ("x", "y")


def test_a_turn_is_read_reasoning_first_then_its_calls_from_the_rest(thinking_tokenizer):
    """tools.read_turn, which the endpoint and the episode loop share, on a thinking model's call: vLLM's deepseek_r1
    parser, then its hermes parser on what the reasoning left."""
    from services.environment.envs.tool_add import ADD_TOOL
    from services.rollout.tools import read_turn

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    g = GenerationConfig(tool_parser="hermes", reasoning_parser="deepseek_r1")
    turn = read_turn(f"<think>add them</think>{call}", g, tokenizer=thinking_tokenizer, tools=[ADD_TOOL])
    assert turn.reasoning == "add them" and [c["function"]["name"] for c in turn.calls] == ["add"]
    assert turn.flaws == 0
    broken = call[:30]  # cut off inside its JSON: hermes reads no call, the markup stays
    turn = read_turn(f"<think>add them</think>{broken}", g, tokenizer=thinking_tokenizer, tools=[ADD_TOOL])
    assert (turn.content, turn.reasoning, turn.calls) == (broken, "add them", [])
    assert turn.flaws == INVALID
    turn = read_turn(f"<think>x</think>{call}", g, tokenizer=thinking_tokenizer, tools=None)
    assert (turn.content, turn.reasoning, turn.calls) == (call, "x", [])  # no tools: no calls read
