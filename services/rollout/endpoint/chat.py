"""POST .../v1/chat/completions: messages (tool calls and tool results included) and tools through the chat
template, the engine's choices back as OpenAI's ChatCompletion, or as its chunk stream.

With `return_token_ids` the answer carries vLLM's fields (top-level `prompt_token_ids`, per choice
`token_ids`), NeMo Gym's on each message (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`)
and Flywheel's per choice `policy_versions` (the policy version that sampled each token). The engines return
whole completions, so a stream carries each choice's text in one delta: it has the shape of a stream, not
earlier tokens.

With `policy.generation.reasoning_parser` a reply's reasoning is its message's `reasoning` (vLLM's field), and
an assistant message sent back with `reasoning` (or the older `reasoning_content`) gives it to the chat template,
as vLLM's server does. Each reply is judged for flaws (services/rollout/flaws.py), which the episode's samples carry.
"""

from __future__ import annotations

import json
import time
import uuid

from services.common.config import GenerationConfig
from services.rollout.endpoint.generation import Generator, Result
from services.rollout.endpoint.recording import Turn
from services.rollout.endpoint.render import (canonical, off_loop_if_long, render_ids, spliced,
                                             template_messages)
from services.rollout.endpoint.schemas import ChatRequest
from services.rollout.endpoint.sessions import Episode
from services.rollout.tools import ParsedTurn, load_reasoning_parser, read_turn


class Chat:
    def __init__(self, generator: Generator, tokenizer, g: GenerationConfig, model_name: str) -> None:
        self.generator, self.tokenizer, self.model_name = generator, tokenizer, model_name
        self.generation = g
        """policy.generation: the parsers and flaw markers that read each reply (tools.read_turn)."""
        self.stops = {tokenizer.eos_token_id, *(generator.default.stop_token_ids or [])}
        if g.reasoning_parser is not None:
            load_reasoning_parser(g.reasoning_parser, tokenizer)

    async def answer(self, episode: Episode, req: ChatRequest) -> tuple[dict, Result]:
        """The ChatCompletion object (and the call's result), recorded in the episode."""
        messages = template_messages(req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        kwargs = req.chat_template_kwargs or {}
        history = canonical(messages, tools)
        prompt = await off_loop_if_long(len(history), self.prompt_ids, episode, messages, tools, kwargs)
        result = await self.generator.generate(episode, "chat", prompt, req, req.budget(), req.n)
        offered = None if req.tool_choice == "none" else tools
        replies = [read_turn(out.text, self.generation, tokenizer=self.tokenizer, tools=offered,
                             chat_template_kwargs=kwargs or None) for out in result.outs]
        turns = [Turn(history=history, reply=reply_key(reply), token_ids=prompt + out.token_ids)
                 for out, reply in zip(result.outs, replies)]
        self.generator.record(episode, result, turns, [r.flaws for r in replies],
                              conversation=messages + assistant_messages(replies[0]))
        return self.completion(req, result, replies), result

    def prompt_ids(self, episode: Episode, messages: list[dict], tools, kwargs: dict) -> list[int]:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is not None:
            history, reply = canonical(messages[:last], tools), canonical([messages[last]])
            recorded = episode.recording.continued(history, reply)
            if recorded is not None:
                ids = spliced(self.tokenizer, messages, tools, kwargs, recorded, self.stops)
                if ids is not None:
                    return ids
        return render_ids(self.tokenizer, messages, tools, kwargs, generation=True)

    def completion(self, req: ChatRequest, result: Result, replies: list) -> dict:
        choices = []
        for i, (out, reply) in enumerate(zip(result.outs, replies)):
            message = {"role": "assistant", "content": reply.content}
            if reply.reasoning is not None:
                message["reasoning"] = reply.reasoning
            if reply.calls:
                message["tool_calls"] = reply.calls
            entries = self.logprobs(out, req.return_tokens_as_token_ids) if req.logprobs else None
            choice = {"index": i, "message": message, "finish_reason": finish(out, reply.calls),
                      "logprobs": {"content": entries} if req.logprobs else None}
            if req.return_token_ids:
                message.update(prompt_token_ids=result.prompt_ids, generation_token_ids=out.token_ids,
                               generation_log_probs=out.logprobs)
                choice.update(token_ids=out.token_ids, policy_versions=out.versions)
            choices.append(choice)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": req.model or self.model_name, "choices": choices,
                "usage": usage(result)}
        if req.return_token_ids:
            body["prompt_token_ids"] = result.prompt_ids
        return body

    def logprobs(self, out, as_ids: bool) -> list[dict]:
        entries = []
        for t, lp in zip(out.token_ids, out.logprobs):
            token = f"token_id:{t}" if as_ids else self.tokenizer.decode([t])
            entries.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return entries


def reply_key(reply: ParsedTurn) -> str:
    """The assistant message as the agent sends it back, canonical (content None and "" alike)."""
    return canonical(assistant_messages(reply))


def assistant_messages(reply: ParsedTurn) -> list[dict]:
    """The reply as the chat template takes it back."""
    from services.rollout.endpoint.schemas import Message

    return template_messages([Message(role="assistant", content=reply.content, reasoning=reply.reasoning,
                                      tool_calls=reply.calls or None)])


def finish(out, calls: list[dict]) -> str:
    return "tool_calls" if calls else ("length" if out.truncated else "stop")


def usage(result: Result) -> dict:
    completion = sum(len(o.token_ids) for o in result.outs)
    return {"prompt_tokens": len(result.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(result.prompt_ids) + completion}


def stream(body: dict, include_usage: bool):
    """The ChatCompletion `body` as chat.completion.chunk events, then [DONE]."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in body["choices"]:
        message, i = choice["message"], choice["index"]
        opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}
        yield sse(head | {"choices": [opening]})
        delta = {"content": message["content"]}
        if "reasoning" in message:
            delta["reasoning"] = message["reasoning"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [c | {"index": j} for j, c in enumerate(message["tool_calls"])]
        yield sse(head | {"choices": [{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                                       "finish_reason": None}]})
        last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        for key in ("token_ids", "policy_versions"):
            if key in choice:
                last[key] = choice[key]
        yield sse(head | {"choices": [last]} | ({"prompt_token_ids": body["prompt_token_ids"]}
                                               if "prompt_token_ids" in body else {}))
    if include_usage:
        yield sse(head | {"choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"
