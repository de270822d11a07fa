"""POST .../v1/completions: a prompt as text or token ids (or a batch of them), no chat template.

An agent that keeps its own token ids sends them here (its last prompt_token_ids + token_ids + what follows),
and the recording sees its calls extend each other exactly. With `return_token_ids` each choice carries vLLM's
`prompt_token_ids` and `token_ids`, and Flywheel's `policy_versions`.
"""

from __future__ import annotations

import time
import uuid

from services.rollout.endpoint.chat import sse
from services.rollout.endpoint.generation import Generator
from services.rollout.endpoint.render import off_loop_if_long
from services.rollout.endpoint.schemas import CompletionRequest
from services.rollout.endpoint.sessions import Episode


class Completions:
    def __init__(self, generator: Generator, tokenizer, model_name: str) -> None:
        self.generator, self.tokenizer, self.model_name = generator, tokenizer, model_name

    async def answer(self, episode: Episode, req: CompletionRequest) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        batch = [p if isinstance(p, list) else await off_loop_if_long(len(p), self.encode, p)
                 for p in req.prompts()]
        for ids in batch:  # a batch is refused before any of it generates
            self.generator.check(episode, ids)
        for ids in batch:
            result = await self.generator.generate(episode, "completions", ids, req, req.max_tokens, req.n)
            self.generator.record(episode, result)
            prompt_tokens += len(ids)
            for out in result.outs:
                completion_tokens += len(out.token_ids)
                logprobs = self.logprobs(out, req) if req.logprobs is not None else None
                choice = {"index": len(choices), "text": out.text, "logprobs": logprobs,
                          "finish_reason": "length" if out.truncated else "stop"}
                if req.return_token_ids:
                    choice.update(prompt_token_ids=ids, token_ids=out.token_ids, policy_versions=out.versions)
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def logprobs(self, out, req: CompletionRequest) -> dict:
        tokens = [f"token_id:{t}" if req.return_tokens_as_token_ids else self.tokenizer.decode([t])
                  for t in out.token_ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": out.logprobs, "top_logprobs": None,
                "text_offset": offsets}


def stream(body: dict, include_usage: bool):
    """The Completion `body` as text_completion chunks (one per choice), then [DONE]."""
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    for choice in body["choices"]:
        yield sse(head | {"choices": [choice]})
    if include_usage:
        yield sse(head | {"choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"
