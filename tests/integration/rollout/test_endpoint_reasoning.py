"""A thinking model behind the endpoint with vLLM's deepseek_r1 reasoning parser (policy.generation.reasoning_parser):
the tiny model, briefly supervised to answer "add a b" as `<think>a+b</think>` then the sum (its tokenizer has the
tags as tokens, as Qwen3's and DeepSeek-R1's do), on the hf engine, asked through the `openai` SDK. The oracle
splits the returned token ids' text at the tags itself; a reply sent back with its reasoning continues the
recorded tokens, as NeMo Gym's model server sends it back."""

from __future__ import annotations

import pytest
import pytest_asyncio
from engine_harness import serving
from openai import AsyncOpenAI
from tool_demos import END_THINK as END
from tool_demos import THINK, thinking_config, thinking_model

from services.common.modeling import load_policy

pytestmark = pytest.mark.asyncio(loop_scope="module")
# The tiny template with assistant turns closed by EOS, as a thinking model's template closes them (<|im_end|>),
# which lets the endpoint splice a reply's recorded tokens back in (render.py); prompts render as the tiny one's.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    cfg = thinking_config(thinking_model(tmp_path_factory.mktemp("thinking_model")), 128)
    async with serving(cfg, "endpoint-reasoning", load_policy(cfg.policy, cfg.run.seed)[0], TEMPLATE) as served:
        yield served


async def test_the_reasoning_comes_apart_from_the_answer_and_a_reply_sent_back_with_it_continues(served):
    endpoint, engine = served
    key, token, base_url = endpoint.open_episode(metadata={"group_id": "g"})
    client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
    question = [{"role": "user", "content": "add 2 3"}]
    r = await client.chat.completions.create(model="policy", messages=question, n=4,
                                             extra_body={"return_token_ids": True})
    split = 0
    for choice in r.choices:
        text = engine.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        reasoning, closed, answer = text.removeprefix(THINK).partition(END)
        got = choice.message.model_extra.get("reasoning")
        if closed:
            assert (got, choice.message.content) == (reasoning, answer or None), text
            split += 1
        else:  # cut off while thinking: all of it is reasoning
            assert (got, choice.message.content) == (reasoning, None), text
    assert split > 0, "the warm-started model closed its thinking in no sample"

    first = r.choices[0].message
    reply = {"role": "assistant", "content": first.content, "reasoning": first.model_extra["reasoning"]}
    await client.chat.completions.create(model="policy", messages=[*question, reply,
                                                                   {"role": "user", "content": "again"}])
    trajectory = endpoint.close_episode(key)
    assert trajectory.new_samples == 0  # the second call's prompt holds the first reply's tokens as sampled
    assert trajectory.samples[0].calls == 2
