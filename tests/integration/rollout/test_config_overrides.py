"""policy.hf_config_overrides on a local checkpoint: both engines build the model the trainer builds. The override
(a large RMSNorm epsilon) changes every logprob of the tiny model, so an engine that dropped it would fail the
logprob parity with the trainer. policy.generation.vllm_kwargs reaches vLLM's engine config. And the checkpoint
directory holds no tokenizer: both engines (vLLM's own detokenizer too) load the one policy.tokenizer.name names."""

from __future__ import annotations

import pytest
import torch
from engine_harness import PARITY, Trainer, policy, token_mult_prob_error, trainer_logprobs

from services.common.config import load_config
from services.common.modeling import load_policy
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids


@pytest.mark.parametrize("backend", ["hf", "vllm"])
async def test_an_engine_applies_the_config_overrides_the_trainer_applies(tmp_path, backend):
    tiny, tokenizer = load_policy(load_config().policy, seed=0)
    tiny.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    cfg = load_config(None, [f"policy.model_name={tmp_path / 'model'}", f"policy.tokenizer.name={tmp_path / 'tokenizer'}",
                             f"policy.generation.backend={backend}",
                             "policy.max_total_sequence_length=96", "++policy.hf_config_overrides.rms_norm_eps=0.01",
                             "++policy.generation.vllm_kwargs.max_num_batched_tokens=1536"])
    engine = make_engine(cfg, f"test-{backend}")
    trainer = Trainer(f"test-{backend}")
    try:
        await engine.start()
        if backend == "vllm":
            assert engine.llm.vllm_config.scheduler_config.max_num_batched_tokens == 1536
        model = policy(cfg, seed=1)
        assert model.config.rms_norm_eps == 0.01
        await trainer.push(engine, 0, model)
        prompt = prompt_token_ids(engine.tokenizer, [{"role": "user", "content": "copy 3"}])
        outs = await engine.generate([prompt] * 8, Sampling(max_new_tokens=16, temperature=0.7))
        gen = torch.cat([torch.tensor(o.logprobs) for o in outs])
        with_override = torch.cat([trainer_logprobs(model, prompt, o, 0.7) for o in outs])
        model.config.rms_norm_eps = 1e-6  # the checkpoint's own value, in every norm layer of the trainer's copy
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-6
        without = torch.cat([trainer_logprobs(model, prompt, o, 0.7) for o in outs])
        assert token_mult_prob_error(gen, with_override) <= PARITY
        assert token_mult_prob_error(gen, without) > PARITY  # the override matters for this model
    finally:
        trainer.close()
        await engine.close()
