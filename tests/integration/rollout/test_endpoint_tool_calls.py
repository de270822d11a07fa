"""Chat with tools through the endpoint returns parsed `tool_calls` (issue 33): the tiny model, briefly supervised
to write tool_add's <tool_call> blocks (tests/tool_demos.py), served by the hf engine behind the endpoint with
vLLM's hermes parser, asked through the `openai` SDK. The oracle reads the calls from the returned token ids
itself (the tiny template writes `<tool_call>{json}</tool_call>`), not through the parser under test; it also
judges which replies are flawed (a call block the parser could not read)."""

from __future__ import annotations

import json
import re

import pytest
import pytest_asyncio
from engine_harness import serving
from openai import AsyncOpenAI

from services.common.config import load_config
from services.common.modeling import load_policy
from services.environment.envs.tool_add import ADD_TOOL
from services.rollout.flaws import INVALID_TOOL_CALL

pytestmark = pytest.mark.asyncio(loop_scope="module")
CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)  # a last block may be cut off
SAMPLES = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tool_model):
    model_dir = tool_model
    cfg = load_config(None, ["policy.generation.backend=hf", f"policy.model_name={model_dir}",
                             "policy.max_total_sequence_length=256", "policy.generation.max_new_tokens=80",
                             "policy.generation.tool_parser=hermes"])
    async with serving(cfg, "endpoint-tools", load_policy(cfg.policy, cfg.run.seed)[0]) as served:
        yield served


def _calls(blocks: list[str]) -> list[tuple[str, dict]]:
    """The (name, arguments) of each block, or none at all when any block is not a call: the hermes format is
    all or nothing, so a sample with one malformed block (the tiny model writes some) answers as plain text."""
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
            calls.append((call["name"], call["arguments"]))
        except (ValueError, KeyError, TypeError):
            return []
    return calls


async def test_a_chat_with_tools_returns_the_calls_the_model_wrote_as_tool_calls(served):
    endpoint, engine = served
    key, token, base_url = endpoint.open_episode(metadata={"group_id": "g"})
    client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "add 2 3"}],
                                             tools=[ADD_TOOL], n=SAMPLES, extra_body={"return_token_ids": True})
    endpoint.close_episode(key)

    parsed = 0
    for choice in r.choices:
        text = engine.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        written = _calls(CALL.findall(text))
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        if not written:
            assert got == [] and choice.finish_reason != "tool_calls", text
            continue
        assert got == written, text
        assert choice.finish_reason == "tool_calls" and all(c.id and c.type == "function"
                                                            for c in choice.message.tool_calls)
        parsed += 1
    assert parsed > 0, "the warm-started model wrote no call in any sample"


@pytest.mark.parametrize("max_tokens", [20, 80])
async def test_a_reply_with_call_markup_the_parser_could_not_read_is_flagged_on_its_tokens(served, max_tokens):
    """At 20 tokens every call block is cut off (the hermes parser reads none: an invalid tool call, NeMo RL's
    flag); at 80 most are whole. The oracle is the text itself: markup in a reply with no tool_calls returned."""
    endpoint, engine = served
    key, token, base_url = endpoint.open_episode(metadata={"group_id": "g"})
    client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "add 2 3"}],
                                             tools=[ADD_TOOL], n=SAMPLES, max_tokens=max_tokens,
                                             extra_body={"return_token_ids": True})
    samples = endpoint.close_episode(key).samples
    flagged = 0
    for choice, sample in zip(r.choices, samples, strict=True):
        text = engine.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        invalid = not choice.message.tool_calls and ("<tool_call>" in text or "</tool_call>" in text)
        generated = [f for f, g in zip(sample.flaws, sample.generated_mask) if g]
        assert generated == [INVALID_TOOL_CALL * invalid] * len(choice.model_extra["token_ids"]), text
        assert not any(f for f, g in zip(sample.flaws, sample.generated_mask) if not g)
        flagged += invalid
    if max_tokens == 20:
        assert flagged > 0, "the warm-started model began no call block in any sample"
