"""vLLM with tensor parallelism 2, for real on CPU (two CPU workers, one core each): the weight channel reaches
TP rank 0 only, which hands the weights to rank 1 over vLLM's TP group. Each rank holds half of every sharded
matrix, so logprobs can match the trainer's only if both ranks loaded the weights that were sent."""

from __future__ import annotations

import pytest
from engine_harness import push_two_versions_and_check_parity

from services.common.config import load_config


async def test_both_tp_ranks_take_each_version_and_generate_with_it():
    cfg = load_config(None, ["policy.generation.backend=vllm", "policy.max_total_sequence_length=96",
                             "policy.generation.vllm_cfg.tensor_parallel_size=2"])
    pushed = await push_two_versions_and_check_parity(cfg, "tp")
    for version, (result, outs) in enumerate(pushed):
        assert result.members_ok == ["tp"]  # one receiver: the worker, not each rank
        assert all(o.versions == [version] * len(o.token_ids) for o in outs)


def test_tp_above_one_needs_the_vllm_engine():
    with pytest.raises(Exception, match="tensor_parallel_size > 1 needs backend vllm"):
        load_config(None, ["policy.generation.vllm_cfg.tensor_parallel_size=2"])
