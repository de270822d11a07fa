"""Chat messages to prompt token ids, splicing in the tokens the episode already recorded.

A chat call carries the whole conversation as text. Rendered plainly, a past assistant turn comes back as the
chat template's tokenization of its text, which need not be the ids the engine sampled (another split of the
same text, a stop token the template writes differently): training on that rendering would pair tokens with
logprobs of other tokens. So when the conversation up to its last assistant message is one the endpoint
answered (same messages and tools before it, that message as the endpoint returned it), the prompt is the
recorded ids (that call's prompt and its sampled tokens) followed by what the template renders after that
turn's end-of-turn stop token, as NeMo RL's OpenAI server does for NeMo Gym (`_replace_prefix_tokens`).
Anything else (a history the agent rewrote or re-templated, a template whose turns end without a stop token)
is rendered plainly, and the recording then starts a new sample for it.
"""

from __future__ import annotations

import asyncio
import json

from services.rollout.endpoint.errors import bad_request
from services.rollout.endpoint.schemas import Message


INLINE_CHARS = 2048
"""Requests up to this many characters (as `canonical` writes them) are rendered and tokenized on the event
loop. Rendering costs ~0.5 ms of CPU per 1000 characters here (~0.2 ms for a one-message chat), and a hop to a
thread ~0.1-0.25 ms more on the path every batch waits on (measured, docs/benchmarks.md). Longer requests
would hold the loop for milliseconds (3 renderings when the history is spliced), so they go to a thread,
where the tokenizer's encode releases the GIL and the loop goes on answering other calls."""


async def off_loop_if_long(size: int, fn, *args):
    """fn(*args), on the event loop when `size` (characters) is at most INLINE_CHARS, else in a thread."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def template_messages(messages: list[Message]) -> list[dict]:
    """Messages as Hugging Face chat templates take them (tool-call arguments as objects, as vLLM passes
    them)."""
    out = []
    for m in messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if m.role == "assistant" and reasoning:  # both names, as vLLM gives templates; "" as none, as content
            d["reasoning"] = d["reasoning_content"] = reasoning
        out.append(d)
    return out


def _arguments(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def canonical(messages: list[dict], tools: list[dict] | None = None) -> str:
    """A key under which two renderings of the same conversation compare equal."""
    return json.dumps([messages, tools or []], sort_keys=True, default=str)


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict,
               generation: bool) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                             tokenize=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - a template refusing a conversation is the caller's
        raise bad_request(f"the chat template refused these messages: {str(err)[:512]}",
                          param="messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def spliced(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict, recorded: list[int],
            stops: set[int]) -> list[int] | None:
    """The prompt as `recorded` (the last assistant turn's prompt + sampled ids) and the template's rendering
    after that turn; None where the template does not allow it (see the module docstring)."""
    k = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    full = render_ids(tokenizer, messages, tools, kwargs, generation=True)
    upto = render_ids(tokenizer, messages[:k + 1], tools, kwargs, generation=False)
    before = render_ids(tokenizer, messages[:k], tools, kwargs, generation=True)
    if full[:len(upto)] != upto or upto[:len(before)] != before:
        return None
    cut = next((j for j in range(len(upto) - 1, len(before) - 1, -1) if full[j] in stops), None)
    if cut is None:
        return None
    # The template's end-of-turn token gives way to the one the engine sampled, if it sampled one.
    return recorded + full[cut + 1:] if recorded and recorded[-1] in stops else recorded + full[cut:]
