"""vLLM serves an exported checkpoint: its greedy tokens and their logprobs match transformers' on the same export."""

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
from services.trainer.export import export_checkpoint

PROMPT = [1, 5, 6, 7]
VLLM_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                       SamplingParams(max_tokens=4, temperature=0, logprobs=0))[0].outputs[0]
    print("RESULT", json.dumps({"ids": list(out.token_ids),
                                "logprobs": [next(iter(lp.values())).logprob for lp in out.logprobs]}))
"""


def _save_checkpoint(run_dir: Path) -> None:
    cfg = load_config(None, [f"run.run_dir={run_dir}"])
    info = init_distributed(120)
    try:
        backend = FSDP2Backend(cfg, info)
        Checkpointer(cfg, info.rank, info.world).save(backend, 1, {})
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_vllm_loads_an_export_and_agrees_with_transformers(tmp_path):
    require_module("vllm")
    _save_checkpoint(tmp_path)
    export_checkpoint(tmp_path / "checkpoints", tmp_path / "hf")
    run = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(tmp_path / "hf"), json.dumps(PROMPT)],
                         capture_output=True, text=True, timeout=600)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stderr[-3000:]
    served = json.loads(line[len("RESULT "):])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(4):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
    assert served["ids"] == ids[len(PROMPT):]
    assert served["logprobs"] == pytest.approx(logprobs, abs=1e-3)
