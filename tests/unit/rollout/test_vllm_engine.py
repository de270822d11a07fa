"""VLLMEngine: the HF-layout staging buffers and the glue, on CPU with a fake LLM; generation and the weight
round trip against a real vLLM, on GPU only (they skip here: no CUDA, no vllm)."""

from __future__ import annotations

import importlib
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.common.config import FlywheelConfig, load_config
from services.common.modeling import load_policy, token_logprobs
from services.common.weights.manifest import Manifest
from services.rollout.engine import Sampling


def _cfg(*overrides: str) -> FlywheelConfig:
    return load_config(None, ["policy.generation.backend=vllm", *overrides])


def _trainer_state(cfg: FlywheelConfig) -> dict[str, torch.Tensor]:
    """What the trainer sends: get_model_state_dict of the load_policy model (FSDP2Policy.full_state_dict)."""
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# -- CPU: no vllm needed ------------------------------------------------------------------------------------


def test_module_imports_without_vllm():
    had = "vllm" in sys.modules
    mod = importlib.import_module("services.rollout.vllm_engine")
    assert hasattr(mod, "VLLMEngine")
    if not had and importlib.util.find_spec("vllm") is None:
        assert "vllm" not in sys.modules  # every vllm import is lazy


@pytest.mark.parametrize("arch,precision",
                         [("llama", "float32"), ("qwen2", "bfloat16"), ("llama", "float16")])
def test_staging_manifest_matches_trainer_state_dict(arch, precision):
    from services.rollout.vllm_engine import hf_manifest, meta_policy_model

    cfg = _cfg(f"policy.tiny.architecture={arch}", f"policy.precision={precision}")
    sent = Manifest.of(_trainer_state(cfg))
    meta = meta_policy_model(cfg.policy, vocab_size=sent.specs[0].shape[0], seed=cfg.run.seed)
    staged = hf_manifest(meta)
    assert [s.name for s in staged.specs] == [s.name for s in sent.specs]
    assert staged.specs == sent.specs
    assert staged.digest == sent.digest  # what WeightReceiver checks before it joins an epoch
    assert all(p.device.type == "meta" for p in meta.parameters())  # no memory spent on the layout


class _FakeModel:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded.extend(weights)
        return {n for n, _ in self.loaded}


class _FakeLLM:
    """The two LLM methods the weight path uses, and generate, with vLLM's call shapes."""

    def __init__(self):
        self.model = _FakeModel()
        self.worker = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.model),
                                                             device=torch.device("cpu")))
        self.resets = 0
        self.requests = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets += 1
        return True

    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        self.requests = list(zip(prompts, sampling_params, strict=True))
        outs = []
        for p, sp in self.requests:
            ids = [5 + k for k in range(sp["max_tokens"])]
            lps = [{t: SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(ids)]
            done = SimpleNamespace(token_ids=ids, logprobs=lps, text="x" * len(ids), finish_reason="length")
            outs.append(SimpleNamespace(outputs=[done]))
        return outs


def test_weight_buffers_receive_then_apply_loads_every_hf_tensor_and_resets_cache():
    from services.common.weights.manifest import checksum
    from services.rollout.vllm_engine import VLLMEngine

    cfg = _cfg()
    fake = _FakeLLM()
    engine = VLLMEngine(cfg, llm=fake)
    sent = _trainer_state(cfg)
    bufs = engine.weight_buffers()
    assert bufs is engine.weight_buffers()  # one allocation, reused every sync
    assert Manifest.of(bufs).digest == Manifest.of(sent).digest
    assert all(t.device.type == "cpu" for t in bufs.values())  # gloo channel -> CPU staging
    with engine.lock:  # what WeightReceiver.receive does under the worker's lock
        for name, t in sent.items():
            bufs[name].copy_(t)
        engine.apply_received_weights()  # re-entrant lock: the worker calls it while holding engine.lock
    assert [n for n, _ in fake.model.loaded] == list(sent)
    assert all(t is bufs[n] for n, t in fake.model.loaded)  # in-process: no copies on the way
    assert checksum(t for _, t in fake.model.loaded) == checksum(sent.values())
    assert fake.resets == 1


def test_tied_lm_head_alias_is_not_sent_to_load_weights():
    from services.rollout.vllm_engine import weights_to_load

    bufs = {"model.embed_tokens.weight": torch.zeros(2), "lm_head.weight": torch.zeros(2),
            "x": torch.zeros(1)}
    assert [n for n, _ in weights_to_load(bufs, tied_embeddings=True)] == ["model.embed_tokens.weight", "x"]
    assert [n for n, _ in weights_to_load(bufs, tied_embeddings=False)] == list(bufs)


def test_apply_before_any_receive_is_an_error():
    from services.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match="nothing was received"):
        VLLMEngine(_cfg(), llm=_FakeLLM()).apply_received_weights()


def test_generate_builds_one_request_per_row_and_maps_outputs():
    from services.rollout.vllm_engine import VLLMEngine

    cfg = _cfg("policy.max_total_sequence_length=10")
    fake = _FakeLLM()
    engine = VLLMEngine(cfg, llm=fake)
    sampling = Sampling(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, stop_strings=["</a>"])
    prompts = [[1, 2, 3], [1] * 10, [1] * 8]  # room for 4, none, 2
    outs = engine.generate(prompts, sampling)
    assert [len(o.token_ids) for o in outs] == [4, 0, 2]
    assert outs[1].truncated and outs[1].text == ""
    assert outs[0].logprobs == [-0.5, -1.0, -1.5, -2.0] and outs[0].truncated
    (p0, sp0), (p2, sp2) = fake.requests
    assert p0 == {"prompt_token_ids": [1, 2, 3]} and p2 == {"prompt_token_ids": [1] * 8}
    assert sp0 == dict(n=1, temperature=0.7, top_p=0.9, top_k=5, max_tokens=4, logprobs=0, stop=["</a>"],
                       include_stop_str_in_output=True)
    assert sp2["max_tokens"] == 2


def test_to_generated_missing_logprob_is_nan_and_finish_reasons():
    from services.rollout.vllm_engine import to_generated

    out = to_generated(SimpleNamespace(token_ids=[3, 4], logprobs=[{3: SimpleNamespace(logprob=-1.0)}, {}],
                                       text="ab", finish_reason="stop"))
    assert out.logprobs[0] == -1.0 and math.isnan(out.logprobs[1]) and not out.truncated


# -- GPU + vllm ----------------------------------------------------------------------------------------------


def _gpu_engine(*overrides: str):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from services.rollout.vllm_engine import VLLMEngine

    # head_dim 64: every vLLM attention backend supports it (the default tiny shape has head_dim 16).
    cfg = _cfg("policy.tiny.hidden_size=128", "policy.tiny.num_attention_heads=2", "policy.precision=float32",
               "policy.max_total_sequence_length=128", "weight_sync.backend=nccl", *overrides)
    engine = VLLMEngine(cfg)
    model, _ = load_policy(cfg.policy, cfg.run.seed, "cuda")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with engine.lock:
        for name, t in state.items():
            engine.weight_buffers()[name].copy_(t)
        engine.apply_received_weights()
    return engine, model, state


@pytest.mark.gpu
def test_gpu_weights_round_trip_into_fused_vllm_parameters():
    engine, _, state = _gpu_engine()

    def read(worker):
        inner = getattr(worker, "worker", None) or worker
        return {n: p.detach().cpu().clone() for n, p in inner.model_runner.model.named_parameters()}

    (params,) = engine.llm.collective_rpc(read)
    hf = {n: t.cpu() for n, t in state.items()}
    vocab = hf["model.embed_tokens.weight"].shape[0]
    assert torch.equal(params["model.embed_tokens.weight"][:vocab], hf["model.embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"][:vocab], hf["lm_head.weight"])
    pre = "model.layers.0"
    qkv = torch.cat([hf[f"{pre}.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(params[f"{pre}.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([hf[f"{pre}.mlp.gate_proj.weight"], hf[f"{pre}.mlp.up_proj.weight"]])
    assert torch.equal(params[f"{pre}.mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(params[f"{pre}.input_layernorm.weight"], hf[f"{pre}.input_layernorm.weight"])
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_generate_logprobs_match_hf_under_temperature(temperature):
    engine, model, _ = _gpu_engine()
    tok = engine.tokenizer
    prompts = [tok.encode("u:1+2\na:")] * 4 + [tok.encode("u:hello\na:")] * 4
    sampling = Sampling(max_new_tokens=16, temperature=temperature)
    outs = engine.generate(prompts, sampling)
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs, strict=True):
        assert 1 <= len(o.token_ids) <= 16 and len(o.logprobs) == len(o.token_ids)
        assert o.truncated == (len(o.token_ids) == 16 and o.token_ids[-1] != tok.eos_token_id)
        ids = torch.tensor([p + o.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(p) - 1:-1]
        ref = token_logprobs(logits, ids[:, len(p):], temperature)[0].cpu()
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=2e-3, rtol=0)
    engine.close()


@pytest.mark.gpu
def test_gpu_stop_string_is_kept_and_ends_generation():
    engine, _, _ = _gpu_engine()
    prompts = [engine.tokenizer.encode("u:abc\na:")] * 16
    outs = engine.generate(prompts, Sampling(max_new_tokens=32, temperature=1.0, stop_strings=["a"]))
    stopped = [o for o in outs if not o.truncated and o.text.endswith("a")]
    assert stopped, "with a one-character stop string some of 16 samples must hit it"
    for o in stopped:
        assert o.text.count("a") == 1
    engine.close()
