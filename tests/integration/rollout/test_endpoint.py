"""The endpoint for real: uvicorn on a free port, the hf engine with the tiny model after a version-0 weight
sync, and the `openai` SDK as the agent's client. The trainer's logprobs come from its own model."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from engine_harness import PARITY, policy, serving, token_mult_prob_error
from openai import AsyncOpenAI, AuthenticationError
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.common.config import load_config
from services.common.modeling import token_logprobs
from services.rollout.endpoint.server import EndpointServer

pytestmark = pytest.mark.asyncio(loop_scope="module")
EXAMPLE = Path(__file__).parents[3] / "examples" / "agent_calculator.py"
LIMIT = 160
# The tiny template, with assistant turns closed by EOS as real chat templates close them (<|im_end|>,
# <|eot_id|>), and past assistant turns rendered otherwise than the model wrote them ([...] here; Qwen3's
# template drops their <think> blocks): a plain re-rendering of the history never extends the recorded tokens.
# Tools, when given, are listed first.
TEMPLATE = ("{{ bos_token }}{% if tools %}s:tools {{ tools | map(attribute='function.name') | join(',') }}"
            "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['role'][0] }}:"
            "{% if m['role'] == 'assistant' %}[{{ m['content'] }}]{{ eos_token }}"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    """(endpoint, engine, the trainer's model at version 0)."""
    cfg = load_config(None, ["policy.generation.backend=hf", f"policy.max_total_sequence_length={LIMIT}",
                             "policy.generation.max_new_tokens=6"])
    model = policy(cfg, seed=cfg.run.seed)
    async with serving(cfg, "endpoint-test", model, TEMPLATE) as (endpoint, engine):
        yield endpoint, engine, model


def agent(endpoint: EndpointServer) -> tuple[str, AsyncOpenAI]:
    key, token, base_url = endpoint.open_episode(metadata={"group_id": "g"})
    return key, AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)


def new_samples() -> float:
    return REGISTRY.get_sample_value("flywheel_endpoint_new_samples_total") or 0.0


@torch.no_grad()
def trainer_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """The trainer's logprob of every token after the first (T = 1, the configured temperature)."""
    ids = torch.tensor([tokens])
    return token_logprobs(model(ids).logits[:, :-1], ids[:, 1:], 1.0)[0]


def assert_trainer_agrees(model, sample) -> None:
    mask = torch.tensor(sample.generated_mask[1:])
    gen = torch.tensor(sample.logprobs[1:])[mask]
    train = trainer_logprobs(model, sample.token_ids)[mask]
    assert len(gen) > 0
    assert token_mult_prob_error(gen, train) <= PARITY


async def test_chat_returns_text_token_ids_logprobs_and_versions(served):
    endpoint, engine, _ = served
    _, client = agent(endpoint)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "copy 3"}],
                                             logprobs=True, n=2, extra_body={"return_token_ids": True})
    prompt = engine.tokenizer("<bos>u:copy 3\na:", add_special_tokens=False).input_ids
    assert r.model_extra["prompt_token_ids"] == prompt
    for choice in r.choices:
        ids = choice.model_extra["token_ids"]
        assert 0 < len(ids) <= 6
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        entries = choice.logprobs.content
        assert [e.logprob for e in entries] == choice.message.model_extra["generation_log_probs"]
        assert all(e.logprob < 0 for e in entries) and len(entries) == len(ids)
        assert choice.model_extra["policy_versions"] == [0] * len(ids)
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)


async def test_streaming_chat_delivers_the_same_completion_as_chunks(served):
    endpoint, engine, _ = served
    _, client = agent(endpoint)
    stream = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    text, finish, ids, usage = "", None, None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            ids = (c.model_extra or {}).get("token_ids", ids)
    assert finish in ("stop", "length") and text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert usage.completion_tokens == len(ids)


async def test_a_multi_call_episode_is_one_sample_whose_logprobs_match_the_trainers(served):
    endpoint, engine, model = served
    key, client = agent(endpoint)
    before = new_samples()
    messages = [{"role": "user", "content": "add 2 3"}]
    replies = []
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages,
                                                 extra_body={"return_token_ids": True})
        replies.append(r)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"ok {turn}"}]
    trajectory = endpoint.close_episode(key)
    [sample] = trajectory.samples
    last = replies[-1]
    assert sample.token_ids == last.model_extra["prompt_token_ids"] + last.choices[0].model_extra["token_ids"]
    generated = [t for t, m in zip(sample.token_ids, sample.generated_mask) if m]
    assert generated == [t for r in replies for t in r.choices[0].model_extra["token_ids"]]
    assert sample.calls == 3 and new_samples() == before
    assert_trainer_agrees(model, sample)


async def test_an_agent_that_retemplates_history_gets_separate_aligned_samples_and_a_count(served):
    endpoint, engine, model = served
    key, client = agent(endpoint)
    before = new_samples()
    first = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "add 2 3"}],
        extra_body={"return_token_ids": True})
    said = first.choices[0].message.content
    # The agent folds the conversation into one user message, as a summarising harness does.
    second = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"add 2 3 then you said {said}; go on"}],
        extra_body={"return_token_ids": True})
    trajectory = endpoint.close_episode(key)
    assert len(trajectory.samples) == 2 and trajectory.new_samples == 1 and new_samples() == before + 1
    for sample, r in zip(trajectory.samples, (first, second)):
        ids = r.choices[0].model_extra["token_ids"]
        assert sample.token_ids == r.model_extra["prompt_token_ids"] + ids
        assert sample.generated_mask == [False] * len(r.model_extra["prompt_token_ids"]) + [True] * len(ids)
        assert_trainer_agrees(model, sample)


async def test_completions_take_text_or_token_ids_and_calls_that_extend_share_a_sample(served):
    endpoint, engine, model = served
    key, client = agent(endpoint)
    a = await client.completions.create(model="policy", prompt="u:copy 7\na:", logprobs=0,
                                        extra_body={"return_token_ids": True})
    sampled = a.choices[0].model_extra["token_ids"]
    ids = a.choices[0].model_extra["prompt_token_ids"] + sampled
    train = trainer_logprobs(model, ids)[-len(sampled):].tolist()
    assert a.choices[0].logprobs.token_logprobs == pytest.approx(train, abs=1e-3)
    b = await client.completions.create(model="policy", prompt=ids + engine.tokenizer("\nu:ok").input_ids,
                                        extra_body={"return_token_ids": True})
    [sample] = endpoint.close_episode(key).samples
    b_extra = b.choices[0].model_extra
    assert sample.token_ids == b_extra["prompt_token_ids"] + b_extra["token_ids"]
    assert sample.calls == 2


async def test_responses_answer_with_nemo_gym_token_fields_and_extend_across_calls(served):
    endpoint, engine, model = served
    key, client = agent(endpoint)
    first = await client.responses.create(model="policy", input="copy 5", instructions="be brief")
    item = first.output[-1].model_extra
    assert item["prompt_token_ids"] == engine.tokenizer("<bos>s:be brief\nu:copy 5\na:",
                                                        add_special_tokens=False).input_ids
    assert len(item["generation_token_ids"]) == len(item["generation_log_probs"]) > 0
    echoed = [o.model_dump(exclude_none=True) for o in first.output]
    history = [{"role": "user", "content": "copy 5"}, *echoed, {"role": "user", "content": "again"}]
    second = await client.responses.create(model="policy", input=history, instructions="be brief")
    [sample] = endpoint.close_episode(key).samples
    last = second.output[-1].model_extra
    assert sample.token_ids == last["prompt_token_ids"] + last["generation_token_ids"] and sample.calls == 2
    assert_trainer_agrees(model, sample)


async def test_models_lists_the_policy(served):
    endpoint, _, _ = served
    _, client = agent(endpoint)
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]


async def test_answers_go_out_with_nagle_off_on_every_connection(served):
    """uvicorn writes an answer's head and body apart: with Nagle on, the body waits for the client's delayed
    ACK (~40 ms a call on Linux, more than a tiny model's batch)."""
    import socket

    endpoint, _, _ = served
    _, client = agent(endpoint)
    await asyncio.gather(*(client.models.list() for _ in range(4)))
    connections = endpoint.server.server_state.connections
    assert connections
    for protocol in connections:
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    await client.close()


async def test_the_example_agent_runs_an_episode_that_trains_as_one_sample(served):
    endpoint, _, model = served
    key, token, base_url = endpoint.open_episode()
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": token}
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, str(EXAMPLE), "add 2 3", env=env,
                                                stdout=pipe, stderr=pipe)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert len([m for m in json.loads(out) if m["role"] == "assistant"]) == 3
    trajectory = endpoint.close_episode(key)
    [sample] = trajectory.samples
    assert trajectory.calls == 3 and sample.calls == 3
    assert_trainer_agrees(model, sample)


def counted(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_each_call_is_a_span_in_the_episodes_trace_and_is_counted(served):
    endpoint, _, _ = served
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer, kept = provider.get_tracer("test"), endpoint.generator.tracer
    endpoint.generator.tracer = tracer
    ok, refused = counted("flywheel_endpoint_calls_total", route="chat", status="200"), \
        counted("flywheel_endpoint_calls_total", route="chat", status="401")
    tokens = counted("flywheel_endpoint_completion_tokens_total")
    try:
        with tracer.start_as_current_span("rollout.group") as group:  # the worker opens it in the group's span
            key, token, base_url = endpoint.open_episode()
        client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(AuthenticationError):
            await AsyncOpenAI(base_url=base_url, api_key="nope", max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        endpoint.generator.tracer = kept
    [span] = [s for s in exporter.get_finished_spans() if s.name == "rollout.endpoint"]
    assert span.parent.span_id == group.get_span_context().span_id
    assert span.context.trace_id == group.get_span_context().trace_id
    assert span.attributes["flywheel.route"] == "chat" and span.attributes["flywheel.session"] == key
    assert span.attributes["flywheel.tokens"] == r.usage.completion_tokens
    assert counted("flywheel_endpoint_calls_total", route="chat", status="200") == ok + 1
    assert counted("flywheel_endpoint_calls_total", route="chat", status="401") == refused + 1
    assert counted("flywheel_endpoint_completion_tokens_total") == tokens + r.usage.completion_tokens


async def test_tools_reach_the_template_and_tool_results_extend_the_sample(served):
    endpoint, engine, model = served
    key, client = agent(endpoint)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "add 2 3"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=tools,
                                                 extra_body={"return_token_ids": True})
    want = engine.tokenizer("<bos>s:tools calc\nu:add 2 3\na:", add_special_tokens=False).input_ids
    assert first.model_extra["prompt_token_ids"] == want
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call-1", "content": "5"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=tools,
                                                  extra_body={"return_token_ids": True})
    [sample] = endpoint.close_episode(key).samples
    sampled = second.choices[0].model_extra["token_ids"]
    assert sample.token_ids == second.model_extra["prompt_token_ids"] + sampled
    assert_trainer_agrees(model, sample)


async def test_the_worker_starts_an_endpoint_on_loopback_only_when_enabled(served):
    from services.rollout.main import start_endpoint

    _, engine, _ = served
    assert await start_endpoint(load_config(None, []), engine, "w") is None
    started = await start_endpoint(load_config(None, ["policy.generation.endpoint.enabled=true"]), engine, "w")
    try:
        assert started.base_url.startswith("http://127.0.0.1:")
        _, client = agent(started)
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    finally:
        await started.stop()
