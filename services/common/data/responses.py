"""NeMo Gym's Responses API items -> OpenAI chat messages and tools (pure).

The rules are those of NeMo Gym's own down-conversion, which its model servers apply before vLLM
generates (nemo_gym/responses_converter.py, ResponsesConverter), so a rollout's conversation becomes
the chat its model was prompted with:
    message (user, system, developer)     -> that message, text parts joined
    message (assistant), reasoning, function_call
                                          -> merged into one assistant message until the next
                                             non-assistant item: text appended, reasoning summaries
                                             as <think>...</think>, each function_call a tool_call
                                             {"id": call_id, "type": "function", "function": {name, arguments}}
    function_call_output                  -> {"role": "tool", "content": output, "tool_call_id": call_id}
    instructions                          -> a system message first (with any leading system/developer text)
    tools (flat function tools)           -> {"type": "function", "function": {name, description, parameters}}
Any other item (hosted MCP, web search, images, ...) has no chat form: Dropped names it.
"""

from __future__ import annotations

from services.common.data.offline import Dropped


def prompt_messages(params: object) -> list[dict]:
    """responses_create_params' `instructions` and `input` as chat messages."""
    if not isinstance(params, dict):
        raise Dropped("no responses_create_params object")
    given = params.get("input")
    items = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given
    messages = chat_from_items(items, "responses_create_params.input")
    instructions = params.get("instructions")
    if instructions:
        lead = [instructions]
        while messages and messages[0]["role"] in ("system", "developer"):
            lead.append(messages.pop(0)["content"])
        messages.insert(0, {"role": "system", "content": "\n\n".join(lead)})
    return messages


def chat_tools(params: dict) -> list[dict] | None:
    """The function tools of responses_create_params in chat form; None when there are none."""
    tools = params.get("tools") or []
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise Dropped(f"a non-function tool has no chat form (tools[{i}]: {kind})")
        fn = {k: v for k, v in tool.items() if k not in ("type", "strict") and v is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_from_items(items: object, what: str) -> list[dict]:
    """Responses input or output items as chat messages, by the rules above."""
    if not isinstance(items, list):
        raise Dropped(f"items that are not a list ({what})")
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message being merged
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Dropped(f"an item that is not an object ({what}[{i}])")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message" and not item.get("role"):
            item = {**item, "role": "assistant"}  # an output message's role defaults to assistant (openai_utils.py)
        if kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant"):
            turn = turn or {"role": "assistant", "content": ""}
            _merge(turn, kind, item, f"{what}[{i}]")
            continue
        if turn is not None:
            messages.append(_closed(turn))
            turn = None
        messages.append(_other(kind, item, f"{what}[{i}]"))
    if turn is not None:
        messages.append(_closed(turn))
    return messages


def _merge(turn: dict, kind: str, item: dict, what: str) -> None:
    if kind == "function_call":
        call = {"type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if item.get("call_id") is not None:
            call = {"id": item["call_id"], **call}
        turn.setdefault("tool_calls", []).append(call)
    elif kind == "reasoning":
        parts = item.get("summary") or item.get("content") or []
        turn["content"] += "".join(f"<think>{t}</think>" for t in _texts(parts, what) if t)
    else:
        turn["content"] += "".join(_texts(item.get("content"), what))
        turn.setdefault("tool_calls", []).extend(item.get("tool_calls") or [])  # chat-shaped turns


def _closed(turn: dict) -> dict:
    return {k: v for k, v in turn.items() if v != []}


def _other(kind: str | None, item: dict, what: str) -> dict:
    if kind == "function_call_output":
        out = {"role": "tool", "content": "".join(_texts(item.get("output"), what))}
        return {**out, "tool_call_id": item["call_id"]} if item.get("call_id") is not None else out
    if kind == "message" and item.get("role") in ("user", "system", "developer", "tool"):
        out = {"role": item["role"], "content": "".join(_texts(item.get("content"), what))}
        return {**out, "tool_call_id": item["tool_call_id"]} if item.get("tool_call_id") is not None else out
    raise Dropped(f"a {kind or 'typeless'} item has no chat form ({what})")


def _texts(content: object, what: str) -> list[str]:
    """Text of a string, or of a list of text parts (input_text, output_text, summary_text, refusal)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = [p.get("text", p.get("refusal")) if isinstance(p, dict) else None for p in content]
        if all(isinstance(t, str) for t in texts):
            return texts
    raise Dropped(f"content other than text ({what}: images, files and audio have no text form here)")
