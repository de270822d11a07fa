"""Bad input to the endpoint: each case a clear 4xx in OpenAI's error shape, never a crash; then fuzzed
requests on every route while generation works, after which the server still answers."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI

from services.common.config import load_config
from services.rollout.endpoint.server import EndpointServer
from services.rollout.engines import make_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
LIMIT = 48
HI = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def endpoint():
    cfg = load_config(None, ["policy.generation.backend=hf", f"policy.max_total_sequence_length={LIMIT}",
                             "policy.generation.max_new_tokens=2"])
    engine = make_engine(cfg, "endpoint-bad-input")
    await engine.start()
    server = EndpointServer(cfg, engine, "endpoint-bad-input")
    await server.start()
    yield server
    await server.stop()
    await engine.close()


def client(base_url: str, token: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)


async def post(url: str, token: str | None, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {token}"} if token else {})
    async with httpx.AsyncClient() as http:
        return await http.post(url, content=content, headers=headers)


def error(response: httpx.Response) -> dict:
    return response.json()["error"]


async def test_malformed_json_is_a_400(endpoint):
    _, token, url = endpoint.open_episode()
    r = await post(f"{url}/chat/completions", token, b'{"messages": [')
    assert r.status_code == 400 and "not valid JSON" in error(r)["message"]
    r = await post(f"{url}/chat/completions", token, b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in error(r)["message"]


async def test_unknown_fields_are_refused_by_name(endpoint):
    _, token, url = endpoint.open_episode()
    with pytest.raises(openai.BadRequestError, match="unknown field.*temprature"):
        await client(url, token).chat.completions.create(model="m", messages=HI,
                                                         extra_body={"temprature": 0.5})
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        await client(url, token).chat.completions.create(model="m", messages=HI, frequency_penalty=0.5)


async def test_a_missing_or_wrong_token_is_a_401(endpoint):
    _, token, url = endpoint.open_episode()
    with pytest.raises(openai.AuthenticationError, match="invalid episode token"):
        await client(url, token + "x").chat.completions.create(model="m", messages=HI)
    r = await post(f"{url}/chat/completions", None, json.dumps({"messages": HI}).encode())
    assert r.status_code == 401 and "missing episode token" in error(r)["message"]
    _, other_token, _ = endpoint.open_episode()  # another episode's token opens no other episode
    with pytest.raises(openai.AuthenticationError):
        await client(url, other_token).chat.completions.create(model="m", messages=HI)


async def test_an_unknown_or_finished_session_is_refused(endpoint):
    key, token, url = endpoint.open_episode()
    with pytest.raises(openai.NotFoundError, match="unknown session"):
        await client(url.replace(key, "0" * 32), token).chat.completions.create(model="m", messages=HI)
    await client(url, token).chat.completions.create(model="m", messages=HI)
    assert endpoint.close_episode(key).calls == 1
    with pytest.raises(openai.APIStatusError, match="finished") as err:
        await client(url, token).chat.completions.create(model="m", messages=HI)
    assert err.value.status_code == 410


async def test_a_prompt_over_the_length_limit_is_context_length_exceeded(endpoint):
    key, token, url = endpoint.open_episode()
    with pytest.raises(openai.BadRequestError) as err:
        await client(url, token).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * LIMIT}])
    assert err.value.code == "context_length_exceeded" and f"{LIMIT} tokens" in err.value.message
    with pytest.raises(openai.BadRequestError, match="context length"):
        await client(url, token).completions.create(model="m", prompt=[5] * LIMIT)
    with pytest.raises(openai.BadRequestError, match="context length"):  # one prompt of a batch: none runs
        await client(url, token).completions.create(model="m", prompt=[[5, 6], [5] * LIMIT])
    # Just under the limit: the completion is cut to the room left.
    r = await client(url, token).completions.create(model="m", prompt=[5] * (LIMIT - 1), max_tokens=50)
    assert r.usage.completion_tokens == 1
    assert endpoint.close_episode(key).calls == 1


SCALAR = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "x", 3]),
                                 "content": st.text(max_size=30) | JSON})
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | JSON}, optional={
    "max_tokens": st.integers(-3, 3) | JSON, "temperature": st.floats(-1, 3) | JSON, "n": st.integers(-1, 3),
    "stop": st.text(max_size=3) | JSON, "top_p": st.floats(-1, 2), "logprobs": st.booleans() | JSON,
    "tools": JSON, "stream": st.booleans(), "seed": st.integers(-5, 2**64),
    "return_token_ids": st.booleans()})
PROMPT = st.text(max_size=30) | st.lists(st.integers(-5, 70), max_size=8) | JSON
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT}, optional={
    "max_tokens": st.integers(-3, 3), "n": st.integers(-1, 3), "logprobs": st.integers(-1, 2) | JSON,
    "echo": JSON})
RESPONSE = st.fixed_dictionaries({"input": st.text(max_size=30) | st.lists(JSON | MESSAGE, max_size=3)},
                                 optional={"max_output_tokens": st.integers(-3, 3), "tools": JSON,
                                           "instructions": JSON, "stream": JSON})
BODY = st.one_of(st.binary(max_size=40), JSON.map(lambda v: json.dumps(v).encode()))
ROUTES = {"chat/completions": CHAT, "completions": COMPLETION, "responses": RESPONSE}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_fuzzed_requests_get_200_or_4xx_and_the_server_lives(endpoint, route):
    _, token, url = endpoint.open_episode()
    statuses: list[int] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=ROUTES[route].map(lambda v: json.dumps(v).encode()) | BODY)
    def send(body: bytes) -> None:
        r = httpx.post(f"{url}/{route}", content=body, timeout=60,
                       headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code == 200 or (400 <= r.status_code < 500 and r.json()["error"]["message"]), r.text

    await asyncio.to_thread(send)  # the server runs on this loop; the fuzzing client on a thread
    assert 200 in statuses or route == "responses" and any(s == 400 for s in statuses)
    r = await client(url, token).chat.completions.create(model="m", messages=HI)
    assert r.choices[0].message.content is not None
