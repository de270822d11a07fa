"""A checkpoint written by 2 FSDP2 ranks exports to a Hugging Face directory that transformers
loads with identical logits to the trainer's own weights."""

import pytest
import torch
from trainer_harness import config, run_ranks, step_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.modeling import load_policy
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.checkpoint import Checkpointer
from services.trainer.distributed import init_distributed
from services.trainer.export import export_checkpoint


def _train_and_save(rank: int, run_dir: str, out: str, extra: list[str]) -> None:
    cfg = config(f"run.run_dir={run_dir}", *extra)
    info = init_distributed(120)
    backend = FSDP2Backend(cfg, info)
    backend.train_step(*step_batch(cfg))
    Checkpointer(cfg, info.rank, info.world).save(backend, 1, {"train/reward_mean": 0.5})
    state = backend.full_state_dict()
    if rank == 0:
        torch.save(state, out)


@pytest.mark.parametrize("extra", [[], ["policy.lora_cfg.enabled=true"]], ids=["full", "lora"])
def test_export_reloads_in_transformers_with_identical_logits(tmp_path, extra):
    """With LoRA the checkpoint holds base and adapters; the export is their merge, as rollout receives it."""
    weights = str(tmp_path / "trained.pt")
    run_ranks(2, _train_and_save, str(tmp_path), weights, extra)
    step_dir = export_checkpoint(tmp_path / "checkpoints", tmp_path / "hf")
    assert step_dir.name == "step_1"
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "generation_config.json").exists()

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained, tokenizer = load_policy(config().policy, seed=123)  # other init: every weight must come from the file
    trained.load_state_dict(torch.load(weights))
    ids = torch.tensor([tokenizer.encode("1+2=3 and 4*5=20")])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)
        untrained, _ = load_policy(config().policy, seed=42)
        assert not torch.equal(exported(input_ids=ids).logits, untrained(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("1+2") == tokenizer.encode("1+2")
