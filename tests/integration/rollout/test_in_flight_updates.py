"""In-flight weight updates on the real vLLM engine (CPU): a version loaded while long completions run.

The swap is placed without timing: a short request submitted after the long ones finishes first, so the
long ones are running (a few tokens in) when the load pauses the engine. With
recompute_kv_cache_after_weight_updates each token is then exactly what its tagged version's weights give.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from engine_harness import Trainer, policy, token_mult_prob_error, trainer_logprobs, until_generating

from services.common.config import load_config
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    cfg = load_config(None, ["policy.generation.backend=vllm", "policy.max_total_sequence_length=128",
                             "grpo.async_grpo.enabled=true", "grpo.async_grpo.in_flight_weight_updates=true",
                             "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true"])
    engine = make_engine(cfg, "test-in-flight")
    await engine.start()
    trainer = Trainer("test-in-flight")
    v0 = policy(cfg, seed=cfg.run.seed)
    await trainer.push(engine, 0, v0)
    yield engine, cfg, trainer, v0
    trainer.close()
    await engine.close()


async def test_a_long_completion_spans_two_versions_and_each_token_carries_the_weights_that_sampled_it(served):
    engine, cfg, trainer, v0 = served
    v1 = policy(cfg, seed=cfg.run.seed + 1)
    prompt = prompt_token_ids(engine.tokenizer, [{"role": "user", "content": "copy 3"}])
    thread, results = trainer.start_sync(1, v1)
    long = asyncio.create_task(engine.generate([prompt] * 8, Sampling(max_new_tokens=100)))
    await until_generating(engine, 8)
    await engine.generate([prompt], Sampling(max_new_tokens=2))  # submitted after them: the long ones run now
    await engine.load_weights(trainer.announced[-1].fields(), timeout_s=120)
    outs = await long
    await asyncio.to_thread(thread.join)
    assert results[0].members_ok == ["test-in-flight"] and engine.version == 1

    spanning = [o for o in outs if o.version_start == 0 and o.version_end == 1]
    assert spanning, [o.versions for o in outs]
    models = {0: v0, 1: v1}
    for o in outs:
        assert o.versions == sorted(o.versions) and set(o.versions) <= {0, 1}
        gen = torch.tensor(o.logprobs)
        mine = torch.tensor(o.versions)
        for v, model in models.items():
            if (mine == v).any():  # each token against the weights of its own tag, the prefix recomputed
                train = trainer_logprobs(model, prompt, o, 1.0)
                assert token_mult_prob_error(gen[mine == v], train[mine == v]) <= 1.05, (v, o.versions)
    # Tokens after the swap really come from the new weights: the old ones score them differently.
    o = max(spanning, key=lambda o: o.versions.count(1))
    after = torch.tensor(o.versions) == 1
    old = trainer_logprobs(v0, prompt, o, 1.0)[after]
    assert token_mult_prob_error(torch.tensor(o.logprobs)[after], old) > 1.05
