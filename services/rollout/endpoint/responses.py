"""POST .../v1/responses: the Responses API as NeMo Gym's model server speaks it, answered through chat.

Input items become chat messages as NeMo Gym's VLLMConverter makes them: `instructions` a leading system
message; `message` items by role (input_text / output_text parts joined); consecutive assistant `message`,
`reasoning` (summary wrapped in <think></think>, or the message's `reasoning` when a reasoning parser serves) and
`function_call` items one assistant message with tool_calls; `function_call_output` a tool message.
Responses-style tools ({type, name, description, parameters}) become chat tools. The answer's output items are a
`reasoning` item (when the reasoning parser found some), a `message` (when there is text or nothing else) and
one `function_call` per tool call; the last item carries NeMo Gym's `prompt_token_ids`, `generation_token_ids`,
`generation_log_probs` and Flywheel's `policy_versions`. Items sent back with those fields are accepted: the
endpoint's own record decides what extends what.
"""

from __future__ import annotations

import time
import uuid

from services.rollout.endpoint.chat import Chat
from services.rollout.endpoint.errors import bad_request
from services.rollout.endpoint.schemas import ChatRequest, ResponsesRequest, parse
from services.rollout.endpoint.sessions import Episode

PASSED = ("model", "temperature", "top_p", "metadata", "store", "user", "service_tier")


async def answer(chat: Chat, episode: Episode, req: ResponsesRequest) -> dict:
    body = {k: getattr(req, k) for k in PASSED if getattr(req, k) is not None}
    body.update(messages=messages(req, chat.generation.reasoning_parser is not None), return_token_ids=True,
                max_tokens=req.max_output_tokens)
    if req.tools:
        body.update(tools=[chat_tool(t) for t in req.tools], tool_choice=req.tool_choice)
    completion, result = await chat.answer(episode, parse(ChatRequest, body))
    choice, out = completion["choices"][0], result.outs[0]
    items = output_items(choice["message"])
    items[-1].update(prompt_token_ids=result.prompt_ids, generation_token_ids=out.token_ids,
                     generation_log_probs=out.logprobs, policy_versions=out.versions)
    u = completion["usage"]
    incomplete = choice["finish_reason"] == "length"
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": completion["model"], "output": items,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": req.instructions, "tools": req.tools, "tool_choice": req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "user": req.user,
            "usage": {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": u["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u["total_tokens"]}}


def messages(req: ResponsesRequest, reasoning_apart: bool = False) -> list[dict]:
    """The request's input items as chat messages. `reasoning_apart` (a reasoning parser serves): a `reasoning`
    item is its assistant message's `reasoning`, as the endpoint answered it; else its summary in <think></think>
    before the text, as NeMo Gym's converter writes it."""
    items = req.input
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    assistant: dict | None = None
    for item in items:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant"):
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                out.append(assistant)
            extend_assistant(assistant, kind, item, reasoning_apart)
            continue
        assistant = None
        if kind == "message":
            out.append({"role": item.get("role"), "content": text(item.get("content"))})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else text(output)})
        else:
            raise bad_request(f"input item type {kind!r} has no chat form here", param="input")
    return out


def extend_assistant(assistant: dict, kind: str, item: dict, reasoning_apart: bool) -> None:
    if kind == "reasoning":
        summary = "".join(s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict))
        if reasoning_apart:
            assistant["reasoning"] = assistant.get("reasoning", "") + summary
        else:
            assistant["content"] += f"<think>{summary}</think>" if summary else ""
    elif kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments")}
        assistant.setdefault("tool_calls", []).append(
            {"id": item.get("call_id"), "type": "function", "function": function})
    else:
        assistant["content"] += text(item.get("content"))


def text(content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                for p in content):
        raise bad_request("content must be a string or a list of text parts", param="input")
    return "".join(p["text"] for p in content)


def chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise bad_request(f"tool type {tool.get('type')!r}: only function tools are served", param="tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def output_items(message: dict) -> list[dict]:
    items = []
    if message.get("reasoning") is not None:
        items.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "completed",
                      "summary": [{"type": "summary_text", "text": message["reasoning"]}]})
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                      "status": "completed", "content": [
                          {"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for call in calls:
        items.append({"id": call["id"], "type": "function_call", "call_id": call["id"], "status": "completed",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    return items
