"""`flywheel export CHECKPOINT OUT`: a trainer checkpoint as a Hugging Face model directory.

CHECKPOINT is a step_N directory, or a checkpoint_dir (its newest complete step_N is taken).
OUT gets model.safetensors, config.json, generation_config.json and the tokenizer files:
what `AutoModelForCausalLM.from_pretrained(OUT)` and `vllm serve OUT` load. One process, no
process group: torch DCP reads the sharded weights whatever number of ranks wrote them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.common.config import LoRAConfig
from services.trainer.checkpoint import STEP_DIR
from services.trainer.lora import apply_lora, merge_lora


def resolve(path: str | Path) -> Path:
    """A step_N directory as given, or the newest complete one inside a checkpoint_dir."""
    path = Path(path)
    if (path / "training_info.json").exists():
        return path
    found = [(int(m.group(1)), p) for p in path.glob("step_*")
             if (m := STEP_DIR.match(p.name)) and (p / "training_info.json").exists()]
    if not found:
        raise FileNotFoundError(f"{path}: neither a complete step_N checkpoint nor a directory holding one")
    return max(found)[1]


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's weights, in the run's policy.precision, as a Hugging Face directory;
    returns the step_N directory read."""
    step_dir = resolve(checkpoint)
    hf = step_dir / "hf"
    policy = yaml.safe_load((step_dir / "config.yaml").read_text())["policy"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=torch.float32)
    lora = LoRAConfig.model_validate(policy.get("lora_cfg") or {})
    if lora.enabled:  # the checkpoint holds the adapters beside the frozen base; export merges them
        apply_lora(model, lora, seed=0)
    state = model.state_dict()  # the parameters themselves: DCP loads into them in place
    dcp.load({"model": state}, checkpoint_id=str(step_dir / "policy"))
    dtype = getattr(torch, policy["precision"])
    model.to(dtype)
    merged = {k: v.to(dtype) for k, v in merge_lora(state, lora.scale).items()} if lora.enabled else None
    out = Path(out)
    model.save_pretrained(out, state_dict=merged, safe_serialization=True)
    GenerationConfig.from_pretrained(hf).save_pretrained(out)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    return step_dir
