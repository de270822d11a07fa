"""A mixture-of-experts policy (Qwen3-MoE's shape, small) through both engines, for real on CPU: each pushed
version of the trainer's weights (Transformers' fused expert tensors, as get_model_state_dict gives them) must
be what the engine samples with, so its logprobs match the trainer's."""

from __future__ import annotations

import pytest
from engine_harness import push_two_versions_and_check_parity

from services.common.config import load_config


@pytest.mark.parametrize("backend", ["hf", "vllm"])
async def test_each_pushed_version_of_a_moe_policy_is_what_the_engine_samples_with(backend):
    cfg = load_config(None, [f"policy.generation.backend={backend}", "policy.max_total_sequence_length=96",
                             "policy.tiny.architecture=qwen3_moe"])
    await push_two_versions_and_check_parity(cfg, "moe")
