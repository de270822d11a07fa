"""`flywheel export --adapter` writes a LoRA run's adapters in PEFT's format: vLLM serves the base model with
them as a LoRA request and gives the greedy tokens and logprobs of the merged export (what rollout was sent),
and without them something else (so the adapters are applied, not ignored)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import require_module
from transformers import AutoModelForCausalLM

from services.common.config import load_config
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.checkpoint import Checkpointer
from services.trainer.distributed import init_distributed
from services.trainer.export import export_adapter, export_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "trainer"))
from trainer_harness import step_batch

PROMPT = [1, 5, 6, 7]
TOKENS = 4  # VLLM_SCRIPT's max_tokens
VLLM_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, enable_lora=True,
              max_lora_rank=8, max_loras=1)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    prompt = [{"prompt_token_ids": json.loads(sys.argv[3])}]
    result = {}
    for name, request in (("adapter", LoRARequest("trained", 1, sys.argv[2])), ("base", None)):
        out = llm.generate(prompt, params, lora_request=request)[0].outputs[0]
        result[name] = {"ids": list(out.token_ids), "logprobs": [next(iter(lp.values())).logprob for lp in out.logprobs]}
    print("RESULT", json.dumps(result))
"""


def _train_and_save(run_dir: Path) -> None:
    cfg = load_config(None, [f"run.run_dir={run_dir}", "policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=8",
                             "policy.optimizer.kwargs.lr=0.05"])
    info = init_distributed(120)
    try:
        backend = FSDP2Backend(cfg, info)
        checkpointer = Checkpointer(cfg, info.rank, info.world)
        checkpointer.save(backend, 0, {})  # B = 0: its export is the base model
        for step in range(3):
            backend.train_step(*step_batch(cfg, seed=step))
        checkpointer.save(backend, 3, {})
    finally:
        torch.distributed.destroy_process_group()


def _greedy(model_dir: Path) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(TOKENS):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
    return ids[len(PROMPT):], logprobs


@pytest.mark.slow
def test_vllm_serves_the_exported_adapter_as_the_merged_model(tmp_path):
    require_module("vllm")
    _train_and_save(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    export_checkpoint(checkpoints / "step_0", tmp_path / "base")
    export_checkpoint(checkpoints / "step_3", tmp_path / "merged")
    assert export_adapter(checkpoints, tmp_path / "adapter").name == "step_3"
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 32.0)
    assert len(config["target_modules"]) == 7 * 2  # the tiny model's 2 layers, each *_proj

    run = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(tmp_path / "base"), str(tmp_path / "adapter"),
                          json.dumps(PROMPT)], capture_output=True, text=True, timeout=900, check=False)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stderr[-3000:]
    served = json.loads(line[len("RESULT "):])

    ids, logprobs = _greedy(tmp_path / "merged")
    assert served["adapter"]["ids"] == ids
    assert served["adapter"]["logprobs"] == pytest.approx(logprobs, abs=1e-3)
    base_ids, base_logprobs = _greedy(tmp_path / "base")
    assert served["base"]["logprobs"] == pytest.approx(base_logprobs, abs=1e-3)
    assert max(abs(a - b) for a, b in zip(base_logprobs, logprobs)) > 1e-2 or base_ids != ids  # the adapter matters


def test_a_checkpoint_without_lora_has_no_adapter_to_export(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    info = init_distributed(120)
    try:
        Checkpointer(cfg, info.rank, info.world).save(FSDP2Backend(cfg, info), 1, {})
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(ValueError, match="trained without policy.lora_cfg"):
        export_adapter(tmp_path / "checkpoints", tmp_path / "adapter")
