"""Flywheel's logprob hook (vllm_worker.logprobs_before_filtering) on vLLM's real samplers, both model runners,
on CPU tensors with top-k/top-p on. The oracle is the trainer's definition computed here from the same logits in
float64: log_softmax(logits / T) over the whole vocabulary, at the sampled token. vllm_samplers.py runs the
samplers in a process of its own (V2's Triton kernels run under Triton's interpreter there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from services.rollout.engines.vllm_worker import logprobs_before_filtering

ROOT = Path(__file__).resolve().parents[3]
ROWS, VOCAB = 6, 64
CASES = {  # per row; top_k 0 and top_p 1.0 are vLLM's "off"
    "top_k": dict(temperature=[0.7, 1.0, 1.3, 0.7, 1.0, 1.3], top_k=[5] * ROWS, top_p=[1.0] * ROWS),
    "top_p": dict(temperature=[0.7, 1.0, 1.3, 0.7, 1.0, 1.3], top_k=[0] * ROWS, top_p=[0.8] * ROWS),
    "top_k_and_top_p": dict(temperature=[0.8] * ROWS, top_k=[10] * ROWS, top_p=[0.9] * ROWS),
    "mixed_rows": dict(temperature=[0.6, 1.0, 1.5, 0.9, 1.2, 0.7], top_k=[5, 0, 20, 0, 3, 0],
                       top_p=[1.0, 0.7, 0.95, 1.0, 1.0, 0.5]),
    "no_filter": dict(temperature=[0.7] * ROWS, top_k=[0] * ROWS, top_p=[1.0] * ROWS),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"cases": {(case, hook): {"v1": ..., "v2": ...}}, "logits": tensor, "v2_sampling_mask": refusal}."""
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    keys = [(name, hook) for name in CASES for hook in (True, False)]
    cases = [{**CASES[name], "logits": logits.tolist(), "hook": hook} for name, hook in keys]
    folder = tmp_path_factory.mktemp("samplers")
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_samplers.py")), str(folder / "cases.json"),
                    str(folder / "out.json")], cwd=ROOT, env=env, check=True, timeout=600)
    out = json.loads((folder / "out.json").read_text())
    return {"cases": dict(zip(keys, out["cases"])), "logits": logits, "v2_sampling_mask": out["v2_sampling_mask"]}


def trainers_logprobs(logits: torch.Tensor, temperature: list[float], sampled: list[int]) -> torch.Tensor:
    """The slow reference: log_softmax(logits / T) over the whole vocabulary, in float64, at each sampled token."""
    scaled = logits.double() / torch.tensor(temperature, dtype=torch.float64)[:, None]
    return scaled.log_softmax(-1).gather(1, torch.tensor(sampled)[:, None])[:, 0]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("name", CASES)
def test_hooked_sampler_returns_the_trainers_logprobs_and_samples_as_vllm_does(runs, runner, name):
    hooked, plain = runs["cases"][name, True][runner], runs["cases"][name, False][runner]
    case = CASES[name]
    assert hooked["sampled"] == plain["sampled"]  # same seeds: the hook leaves sampling alone
    expected = trainers_logprobs(runs["logits"], case["temperature"], hooked["sampled"])
    torch.testing.assert_close(torch.tensor(hooked["logprobs"], dtype=torch.float64), expected,
                               rtol=0, atol=1e-5)
    for row, token in enumerate(hooked["sampled"]):  # and a top-k filter was applied to the sampling
        k = case["top_k"][row]
        assert k == 0 or (runs["logits"][row] > runs["logits"][row, token]).sum() < k


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_without_the_hook_vllm_renormalises_over_the_kept_tokens(runs, runner):
    """Why the hook exists, on both runners: vLLM's processed logprobs are taken after the filter. Checked exactly
    on the rows that use top-k alone (the kept set is the k largest logits) and on unfiltered rows."""
    checked = 0
    for name, case in CASES.items():
        plain = runs["cases"][name, False][runner]
        for row, (got, token) in enumerate(zip(plain["logprobs"], plain["sampled"])):
            if case["top_p"][row] == 1.0:
                scaled = runs["logits"][row].double() / case["temperature"][row]
                kept = scaled.topk(case["top_k"][row] or VOCAB).values
                assert got == pytest.approx((scaled[token] - kept.logsumexp(0)).item(), abs=1e-5), (name, row)
                checked += 1
    assert checked == 2 * ROWS + 3


def test_a_v2_sampler_that_returns_its_sampling_mask_is_refused(runs):
    assert "return_sampling_mask" in runs["v2_sampling_mask"]


def test_a_sampler_in_another_logprobs_mode_is_refused():
    from vllm.v1.sample.sampler import Sampler

    with pytest.raises(RuntimeError, match="logprobs_mode='raw_logprobs'; Flywheel needs 'processed_logprobs'"):
        logprobs_before_filtering(Sampler(logprobs_mode="raw_logprobs"))


def test_a_sampler_of_neither_runners_shape_is_refused_rather_than_left_renormalised():
    """A later vLLM: no topk_topp_sampler, and a V2-like stage whose arguments are not the ones the hook reads."""

    class LaterSampler:
        logprobs_mode = "processed_logprobs"
        sampling_states = None

        def _sample_random(self, logits, k, p):
            return logits.argmax(-1), logits

    with pytest.raises(RuntimeError, match="LaterSampler is neither the V1 runner's"):
        logprobs_before_filtering(LaterSampler())
    with pytest.raises(RuntimeError, match="neither the V1 runner's"):
        logprobs_before_filtering(types.SimpleNamespace(logprobs_mode="processed_logprobs"))
