"""Tool calls in generated text, and chat templates rendered with tools.

`read_turn` reads a generated turn as vLLM's chat server reads a reply: `split_reasoning` takes a thinking model's
reasoning off (`policy.generation.reasoning_parser`, vLLM's reasoning parsers), then `parse_tool_calls` reads the
calls a model wrote from the rest, with the parser of its family that vLLM ships
(`policy.generation.tool_parser`: "hermes", "llama3_json", "qwen3_coder", "mistral", ... any name in vLLM's
`ToolParserManager`), and the turn is judged for flaws (flaws.py). The parsers are pure Python over the tokenizer,
so the hf backend uses them too; only the vllm package must be installed (the config refuses a tool_parser without
it). Both the episode loop and the OpenAI-compatible endpoint call it.

`render` applies the chat template with `tools=`; `observation_text` is what the template writes for the
environment's messages (tool results) after the conversation so far, up to the next assistant prompt: the
episode appends those tokens, loss mask 0, and never re-tokenizes the turns before them.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from dataclasses import dataclass

from services.common.config import GenerationConfig
from services.rollout.flaws import turn_flaws

# A policy in training writes malformed calls often; vLLM's parsers log each with its traceback and answer "no
# call", which is what the episode records. Keep their errors out of the worker's log.
logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)


def parse_tool_calls(text: str, *, parser: str | None, tokenizer, tools: list[dict] | None
                     ) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of one generated text. No parser: (text, []). Text the parser cannot read as a
    call (no call markup, malformed JSON) is content with no calls, as vLLM's server answers it. `tools`: OpenAI's
    list of definitions offered (some parsers check names or argument types against it)."""
    if parser is None:
        return text, []
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="flywheel", messages=[], tools=tools or None)
    info = _parser(parser, tokenizer).extract_tool_calls(text, request)
    if not info.tools_called:
        return info.content, []
    calls = [{"id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in info.tool_calls]
    return info.content, calls


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """One generated turn as read: its answer, reasoning and OpenAI tool_calls, and its TurnFlaw bits (flaws.py)."""

    content: str | None
    reasoning: str | None
    calls: list[dict]
    flaws: int


def read_turn(text: str, g: GenerationConfig, *, tokenizer, tools: list[dict] | None,
              chat_template_kwargs: dict | None = None) -> ParsedTurn:
    """One generated turn as vLLM's chat server reads a reply, with policy.generation's parsers: the reasoning
    parser first, then, when tools are offered, the tool parser on what it left (a turn without calls keeps all its
    text but the reasoning as content); then judged for flaws with its markers."""
    reasoning, content = split_reasoning(text, parser=g.reasoning_parser, tokenizer=tokenizer,
                                         chat_template_kwargs=chat_template_kwargs)
    calls: list[dict] = []
    if content is not None and tools:
        parsed, calls = parse_tool_calls(content, parser=g.tool_parser, tokenizer=tokenizer, tools=tools)
        content = parsed if calls else content
    flaws = turn_flaws(content, reasoning, calls, patterns=g.invalid_tool_call_patterns, tags=g.thinking_tags)
    return ParsedTurn(content=content, reasoning=reasoning, calls=calls, flaws=flaws)


def split_reasoning(text: str, *, parser: str | None, tokenizer, chat_template_kwargs: dict | None = None
                    ) -> tuple[str | None, str | None]:
    """(reasoning, the rest) of one generated text, by vLLM's reasoning parser `parser`, as its chat server splits
    them before reading tool calls from the rest. `chat_template_kwargs`: the request's, which vLLM builds its
    parser with (some read whether thinking was on: deepseek_v3's `thinking`). No parser: (None, text)."""
    if parser is None:
        return None, text
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    kwargs = json.dumps(chat_template_kwargs or {}, sort_keys=True, default=str)
    request = ChatCompletionRequest(model="flywheel", messages=[], chat_template_kwargs=chat_template_kwargs)
    return _reasoning_parser(parser, tokenizer, kwargs).extract_reasoning(text, request)


def load_reasoning_parser(name: str, tokenizer) -> None:
    """Raises ValueError naming vLLM's reasoning parsers when `name` is not one of them, or when it cannot read
    this tokenizer (a thinking parser needs its tags in the vocabulary): at a worker's start, not its first call."""
    from vllm.reasoning import ReasoningParserManager

    if name not in ReasoningParserManager.list_registered():
        raise ValueError(f"policy.generation.reasoning_parser {name!r} is not one of vLLM's reasoning parsers: "
                         f"{', '.join(ReasoningParserManager.list_registered())}")
    try:
        _reasoning_parser(name, tokenizer, "{}")
    except Exception as err:  # noqa: BLE001 - vLLM's parsers fail in their own ways on a vocabulary they cannot read
        raise ValueError(f"policy.generation.reasoning_parser {name!r} cannot read this tokenizer: {err}") from None


@functools.lru_cache(maxsize=16)
def _reasoning_parser(name: str, tokenizer, chat_template_kwargs: str):
    """One parser per (name, tokenizer, the request's chat_template_kwargs as JSON), as vLLM builds one per request
    with them; only the non-streaming `extract_reasoning` is called, which keeps no state between calls."""
    from vllm.reasoning import ReasoningParserManager

    kwargs = json.loads(chat_template_kwargs)
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer, chat_template_kwargs=kwargs or None)


def load_parser(name: str, tokenizer) -> None:
    """Raises ValueError naming vLLM's parsers when `name` is not one of them: a worker checks at start, not at
    its first tool call."""
    from vllm.tool_parsers import ToolParserManager

    if name not in ToolParserManager.list_registered():
        raise ValueError(f"policy.generation.tool_parser {name!r} is not one of vLLM's tool parsers: "
                         f"{', '.join(sorted(ToolParserManager.list_registered()))}")
    _parser(name, tokenizer)


@functools.lru_cache(maxsize=8)
def _parser(name: str, tokenizer):
    """One parser per (name, tokenizer): constructing one may read the whole vocabulary. Only the non-streaming
    `extract_tool_calls` is called, which keeps no state between calls."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)(tokenizer)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as Hugging Face chat templates take them: tool-call arguments as objects, not JSON text (what
    vLLM's renderer does too); arguments that do not parse stay text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _loads(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
    """The chat template's text of `messages`, with `tools` passed only when there are some (templates test
    `tools is not none`)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **extra)


class TemplateDrift(ValueError):
    """The template renders the earlier turns differently once the new messages follow (e.g. it drops past
    reasoning): the new messages' text cannot be cut off the end."""


def observation_text(tokenizer, messages: list[dict], observations: list[dict], tools: list[dict] | None) -> str:
    """What the chat template writes for `observations` after `messages` (which end with the assistant's turn),
    through the next assistant prompt. The template's own end of the assistant turn is in `messages`' rendering,
    so it is not repeated: the generated end (EOS or a stop string) stands for it."""
    before = render(tokenizer, messages, tools, add_generation_prompt=False)
    after = render(tokenizer, messages + observations, tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise TemplateDrift("the chat template rewrites earlier turns when tool results follow")
    return after[len(before):]
