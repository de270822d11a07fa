"""A multimodal checkpoint (Gemma 4: a language model with vision and audio towers) trains on text.

NeMo RL's Gemma 4 recipes freeze the towers through Automodel's `freeze_config`; Flywheel accepts that key without
effect because on text the towers take no input. This is the check behind that: a small Gemma 4 checkpoint, built
here from transformers' own config classes and saved as a user's would be, loaded through the trainer's real
loading code, one GRPO step. Every parameter under a module whose name Automodel's freezing matches gets no gradient
and keeps its value; every other parameter moves; and the weights the trainer publishes are the ones the rollout's
manifest expects for the same checkpoint.
"""

import torch
from trainer_harness import config, run_ranks, step_batch

from services.common.tokenizing import build_tiny_tokenizer
from services.common.weights import Manifest
from services.rollout.engines.vllm import hf_manifest, meta_policy_model
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

TOWERS = ("vision", "visual", "image_encoder", "audio", "audio_encoder", "speech", "sound")
"""Automodel's freeze_vision_tower and freeze_audio_tower patterns (at NeMo RL's pin): a module whose name holds one."""


def _checkpoint(path) -> None:
    from transformers import AutoModelForCausalLM, Gemma4Config
    from transformers.models.gemma4 import Gemma4AudioConfig, Gemma4TextConfig, Gemma4VisionConfig

    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    text = Gemma4TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, intermediate_size=128, vocab_size=vocab, hidden_size_per_layer_input=16,
                            vocab_size_per_layer_input=vocab, layer_types=["sliding_attention", "full_attention"])
    vision = Gemma4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                head_dim=16, intermediate_size=64)
    audio = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"  # what AutoModelForCausalLM loads for gemma4
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _train(rank: int, path: str, out: str) -> None:
    cfg = config(f"policy.model_name={path}", "policy.max_total_sequence_length=64")
    backend = FSDP2Backend(cfg, init_distributed(120))
    towers = {f"{module}.{name}" if module else name for module, m in backend.model.named_modules()
              if any(p in module.lower() for p in TOWERS) for name, _ in m.named_parameters()}
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    with_grad: list[str] = []
    backend.optimizer.register_step_pre_hook(lambda *_: with_grad.extend(
        n for n, p in backend.model.named_parameters() if p.grad is not None))
    backend.train_step(*step_batch(cfg))
    moved = [n for n, p in backend.model.named_parameters() if not torch.equal(p, before[n])]
    published = Manifest.of(backend.full_state_dict())
    rollout = hf_manifest(meta_policy_model(cfg.policy, len(backend.tokenizer), cfg.run.seed))
    torch.save({"towers": sorted(towers), "names": sorted(before), "with_grad": sorted(with_grad),
                "moved": sorted(moved), "digests": (published.digest, rollout.digest)}, out)


def test_a_gemma4_checkpoint_trains_on_text_with_its_towers_untouched_and_publishes_the_rollouts_manifest(tmp_path):
    path, out = str(tmp_path / "gemma4"), str(tmp_path / "out.pt")
    _checkpoint(path)
    run_ranks(1, _train, path, out)
    r = torch.load(out)
    towers, language = set(r["towers"]), set(r["names"]) - set(r["towers"])
    assert any("vision_tower" in n for n in towers) and any("audio_tower" in n for n in towers), towers
    assert any("embed_vision" in n for n in towers)  # the projectors too, as Automodel's patterns match them
    assert towers.isdisjoint(r["with_grad"]), sorted(towers & set(r["with_grad"]))
    assert towers.isdisjoint(r["moved"])
    assert set(r["moved"]) == language, sorted(language - set(r["moved"]))
    assert r["digests"][0] == r["digests"][1]
