"""`flywheel export CHECKPOINT OUT [--adapter]`: a trainer checkpoint as a Hugging Face model directory.

CHECKPOINT is a step_N directory, or a checkpoint_dir (its newest complete step_N is taken).
OUT gets model.safetensors, config.json, generation_config.json and the tokenizer files:
what `AutoModelForCausalLM.from_pretrained(OUT)` and `vllm serve OUT` load. A LoRA run's adapters are
merged into the weights. With --adapter, OUT gets the adapters alone in PEFT's format instead
(adapter_model.safetensors, adapter_config.json naming policy.model_name as the base): what
`PeftModel.from_pretrained(base, OUT)` and vLLM's LoRA requests load. One process, no process group: torch
DCP reads the sharded weights whatever number of ranks wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)

from services.common.config import LoRAConfig
from services.trainer.checkpoint import STEP_DIR
from services.trainer.lora import A_SUFFIX, B_SUFFIX, apply_lora, merge_lora

PEFT_PREFIX = "base_model.model."
"""PEFT names a LoRA tensor by the wrapped model's path to it: base_model.model.<module>.lora_A.weight."""


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
    step_dir, policy, lora, model, _ = _load(checkpoint)
    state = model.state_dict()
    dtype = getattr(torch, policy["precision"])
    model.to(dtype)
    merged = {k: v.to(dtype) for k, v in merge_lora(state, lora.scale).items()} if lora.enabled else None
    out = Path(out)
    model.save_pretrained(out, state_dict=merged, safe_serialization=True)
    if (step_dir / "hf" / "generation_config.json").exists():  # a reward model (rm:) has none
        GenerationConfig.from_pretrained(step_dir / "hf").save_pretrained(out)
    AutoTokenizer.from_pretrained(step_dir / "hf").save_pretrained(out)
    return step_dir


def export_adapter(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a LoRA run's adapters in PEFT's format, for the base model the run started from (policy.model_name;
    its weights stay frozen in training, so any copy of it is the base); returns the step_N directory read."""
    step_dir, policy, lora, model, adapted = _load(checkpoint)
    if not lora.enabled:
        raise ValueError(f"{step_dir}: trained without policy.lora_cfg, so there is no adapter; export the model")
    state = model.state_dict()
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in state.items() if k.endswith((A_SUFFIX, B_SUFFIX))}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {  # PEFT's LoraConfig: scale = lora_alpha / r, as Flywheel's alpha / dim
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": policy["model_name"],
        "r": lora.dim, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": adapted,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
        "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return step_dir


def _load(checkpoint: str | Path):
    """(step_N, its policy config, its LoRAConfig, the model in float32 with the checkpoint's weights (and
    adapters, for a LoRA run), the names of the adapted modules)."""
    step_dir = resolve(checkpoint)
    policy = yaml.safe_load((step_dir / "config.yaml").read_text())["policy"]
    config = AutoConfig.from_pretrained(step_dir / "hf")
    scorer = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])  # an rm: run's
    auto = AutoModelForSequenceClassification if scorer else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    lora = LoRAConfig.model_validate(policy.get("lora_cfg") or {})
    # The checkpoint holds the adapters beside the frozen base: the same modules get them before the load.
    adapted = apply_lora(model, lora, seed=0) if lora.enabled else []
    dcp.load({"model": model.state_dict()}, checkpoint_id=str(step_dir / "policy"))  # in place, into the parameters
    return step_dir, policy, lora, model, adapted
