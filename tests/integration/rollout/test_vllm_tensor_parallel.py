"""vLLM with tensor parallelism 2, for real on CPU (two CPU workers, one core each): the weight channel reaches
TP rank 0 only, which hands the weights to rank 1 over vLLM's TP group. Each rank holds half of every sharded
matrix, so logprobs can match the trainer's only if both ranks loaded the weights that were sent."""

from __future__ import annotations

import pytest
from engine_harness import Trainer, policy, sample_and_score, token_mult_prob_error

from services.common.config import load_config
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids

PARITY = 1.05


async def test_both_tp_ranks_take_each_version_and_generate_with_it():
    cfg = load_config(None, ["policy.generation.backend=vllm", "policy.max_total_sequence_length=96",
                             "policy.generation.vllm_cfg.tensor_parallel_size=2"])
    engine = make_engine(cfg, "tp")
    trainer = Trainer("tp")
    try:
        await engine.start()
        prompt = prompt_token_ids(engine.tokenizer, [{"role": "user", "content": "copy 3"}])
        sampling = Sampling(max_new_tokens=12, temperature=0.8)
        for version, seed in ((0, cfg.run.seed), (1, cfg.run.seed + 1)):
            model = policy(cfg, seed=seed)
            result = await trainer.push(engine, version, model)  # one receiver: the worker, not each rank
            assert result.members_ok == ["tp"]
            outs, gen, train = await sample_and_score(engine, model, prompt, sampling, 4)
            assert len(gen) > 0 and token_mult_prob_error(gen, train) <= PARITY, version
            assert all(o.versions == [version] * len(o.token_ids) for o in outs)
    finally:
        trainer.close()
        await engine.close()


def test_tp_above_one_needs_the_vllm_engine():
    with pytest.raises(Exception, match="tensor_parallel_size > 1 needs backend vllm"):
        load_config(None, ["policy.generation.vllm_cfg.tensor_parallel_size=2"])
