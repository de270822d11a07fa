"""The vLLM backend's pure parts: the HF layout it stages, its request parameters, and how vLLM's outputs
(token ids, logprobs, weight-version spans) become Generated rows. The engine itself runs in
tests/integration/rollout/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.common.config import load_config
from services.common.modeling import load_policy
from services.common.weights.manifest import Manifest
from services.rollout.engines import Sampling


def test_importing_the_backend_imports_no_vllm():
    """In a fresh interpreter: in this one an earlier test may have imported vllm already. The rollout image
    imports vllm only when it builds the engine."""
    code = ("import sys, services.rollout.engines.vllm, services.rollout.engines.vllm_worker\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("arch,precision,overrides", [
    ("llama", "float32", []), ("qwen2", "bfloat16", []), ("llama", "float16", []), ("qwen3", "float32", []),
    ("qwen2", "float32", ["++policy.hf_config_overrides.intermediate_size=40"]),  # both sides build the new shape
])
def test_staged_layout_is_the_trainers_state_dict(arch, precision, overrides):
    from services.rollout.engines.vllm import hf_manifest, meta_policy_model

    cfg = load_config(None, [f"policy.tiny.architecture={arch}", f"policy.precision={precision}", *overrides])
    model, tok = load_policy(cfg.policy, cfg.run.seed)
    sent = Manifest.of(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    meta = meta_policy_model(cfg.policy, len(tok), cfg.run.seed)
    assert hf_manifest(meta).digest == sent.digest  # what WeightReceiver checks before it joins an epoch
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert meta.model.layers[0].mlp.up_proj.weight.shape[0] == (40 if overrides else cfg.policy.tiny.intermediate_size)


def test_tiny_model_head_dim_is_one_vllm_cpu_attention_accepts():
    t = load_config().policy.tiny
    assert t.hidden_size // t.num_attention_heads >= 32


def test_sampling_params_carry_every_setting():
    from vllm import SamplingParams

    from services.rollout.engines.vllm import sampling_kwargs

    s = Sampling(max_new_tokens=9, temperature=0.5, top_p=0.8, top_k=7, stop_strings=["\n"], stop_token_ids=[5],
                 seed=11)
    p = SamplingParams(**sampling_kwargs(s, max_tokens=6))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.stop_token_ids, p.seed, p.logprobs) == \
        (6, 0.5, 0.8, 7, ["\n"], [5], 11, 0)
    assert p.include_stop_str_in_output
    assert SamplingParams(**sampling_kwargs(Sampling(max_new_tokens=3), 3)).top_k in (0, -1)  # disabled


def test_weight_version_spans_become_one_version_per_token():
    from vllm.outputs import WeightVersionSpan

    from services.rollout.engines.vllm import token_versions

    spans = [WeightVersionSpan("3", 0, 4), WeightVersionSpan("4", 4, 6)]
    assert token_versions(spans, 6) == [3, 3, 3, 3, 4, 4]
    assert token_versions([WeightVersionSpan("default", 0, 2)], 2) == [-1, -1]  # dummy weights
    assert token_versions(None, 3) == [-1, -1, -1]


def test_completion_output_becomes_generated_with_nan_for_a_missing_logprob():
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    from services.rollout.engines.vllm import to_generated

    out = CompletionOutput(index=0, text="ab", token_ids=[5, 6, 7], cumulative_logprob=None,
                           logprobs=[{5: Logprob(-0.5)}, {6: Logprob(-1.5)}, {}], finish_reason="length",
                           weight_versions=[WeightVersionSpan("1", 0, 1), WeightVersionSpan("2", 1, 3)])
    g = to_generated(out)
    assert g.token_ids == [5, 6, 7] and g.logprobs[:2] == [-0.5, -1.5] and torch.isnan(torch.tensor(g.logprobs[2]))
    assert g.truncated and g.versions == [1, 2, 2] and (g.version_start, g.version_end) == (1, 2)


def test_vllm_kwargs_pass_through_unless_unknown_or_set_by_flywheel():
    from services.rollout.engines.vllm import engine_kwargs

    ours, known = {"model": "m", "max_num_seqs": 8}, {"model", "max_num_seqs", "max_num_batched_tokens"}
    assert engine_kwargs(ours, {"max_num_batched_tokens": 4096}, known) == {**ours, "max_num_batched_tokens": 4096}
    with pytest.raises(ValueError, match="vllm_kwargs: max_num_tokns: not vLLM engine arguments"):
        engine_kwargs(ours, {"max_num_tokns": 1}, known)
    with pytest.raises(ValueError, match="vllm_kwargs: max_num_seqs: set by Flywheel"):
        engine_kwargs(ours, {"max_num_seqs": 64}, known)


def test_expert_parallelism_is_vllms_over_the_engines_tensor_parallel_ranks_and_needs_gpus():
    from services.common.config import ConfigError
    from services.rollout.engines.vllm import engine_parallelism

    v = load_config(None, ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=4",
                           "policy.generation.vllm_cfg.expert_parallel_size=4"]).policy.generation.vllm_cfg
    assert engine_parallelism(v, cuda=True) == dict(tensor_parallel_size=4, enable_expert_parallel=True)
    assert engine_parallelism(v.model_copy(update={"expert_parallel_size": 1}), cuda=False) == dict(
        tensor_parallel_size=4, enable_expert_parallel=False)
    with pytest.raises(ValueError, match="needs GPUs: vLLM's CPU MoE kernels crash"):
        engine_parallelism(v, cuda=False)
    with pytest.raises(ConfigError, match="vllm_cfg.expert_parallel_size: 8 is neither 1 nor tensor_parallel_size"):
        load_config(None, ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=4",
                           "policy.generation.vllm_cfg.expert_parallel_size=8"])
