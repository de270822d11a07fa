"""A mixture-of-experts policy (Qwen3-MoE's shape, small) through both engines, for real on CPU: each pushed
version of the trainer's weights (Transformers' fused expert tensors, as get_model_state_dict gives them) must
be what the engine samples with, so its logprobs match the trainer's."""

from __future__ import annotations

import pytest
from engine_harness import Trainer, policy, sample_and_score, token_mult_prob_error

from services.common.config import load_config
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids

PARITY = 1.05


@pytest.mark.parametrize("backend", ["hf", "vllm"])
async def test_each_pushed_version_of_a_moe_policy_is_what_the_engine_samples_with(backend):
    cfg = load_config(None, [f"policy.generation.backend={backend}", "policy.max_total_sequence_length=96",
                             "policy.tiny.architecture=qwen3_moe"])
    engine = make_engine(cfg, "moe")
    trainer = Trainer("moe")
    try:
        await engine.start()
        prompt = prompt_token_ids(engine.tokenizer, [{"role": "user", "content": "copy 3"}])
        sampling = Sampling(max_new_tokens=12, temperature=0.8)
        for version, seed in ((0, cfg.run.seed), (1, cfg.run.seed + 1)):  # the second reloads a loaded model
            model = policy(cfg, seed=seed)
            await trainer.push(engine, version, model)
            outs, gen, train = await sample_and_score(engine, model, prompt, sampling, 4)
            assert len(gen) > 0 and token_mult_prob_error(gen, train) <= PARITY, version
    finally:
        trainer.close()
        await engine.close()
