"""FSDP2 expert parallelism (policy.expert_parallel_size; services/trainer/backends/expert_parallel.py).

The oracle is the same trainer without it: gloo ranks, a small Qwen3-MoE or Nemotron-H (4 experts, 2 per token),
two GRPO steps with SGD (so a gradient off by any factor shows in the weights) and a KL term (the reference is split
the same way), once with each EP group of two ranks holding half of each layer's experts, tokens sent to them by
all-to-all and the layers recomputed in backward, once with FSDP2 alone. The weights after both steps, the step
metrics and the published state must agree, and the experts must sit on the expert mesh. It found torch 2.13
dividing an expert's gradient twice where its FSDP2 group is one rank and sums are forced (expert_parallel.py).
"""

import pytest
import torch
from trainer_harness import assert_trained_alike, config, run_ranks, step_batch

from services.common.config import ConfigError, load_config
from services.common.tokenizing import build_tiny_tokenizer
from services.common.weights import Manifest
from services.rollout.engines.vllm import hf_manifest, meta_policy_model
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

MOE = ["policy.optimizer={name: SGD, kwargs: {lr: 0.1}}", "loss_fn.reference_policy_kl_penalty=0.05",
       "policy.train_global_batch_size=8"]


def nemotron_h_checkpoint(path) -> None:
    """A small Nemotron-H (Mamba, MoE and attention layers; NeMo RL's nanov3 recipes), for which transformers has no
    expert-parallel plan of its own (expert_parallel.PLANS). Mamba runs its reference PyTorch path on CPU."""
    from transformers import AutoModelForCausalLM, NemotronHConfig

    tokenizer = build_tiny_tokenizer()
    cfg = NemotronHConfig(vocab_size=len(tokenizer), hidden_size=64, layers_block_type=["mamba", "moe", "attention", "moe"],
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                          use_mamba_kernels=False, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                          chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1, tie_word_embeddings=False,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _train(rank: int, out: str, model: list[str], ep: int) -> None:
    # The split run also recomputes its layers in backward (the all-to-all again), as NeMo RL's MoE recipes do.
    cfg = config(*MOE, *model, f"policy.expert_parallel_size={ep}", f"policy.activation_checkpointing={ep > 1}")
    backend = FSDP2Backend(cfg, init_distributed(120))
    meshes = {p.device_mesh.mesh_dim_names for n, p in backend.model.named_parameters() if ".experts." in n}
    assert backend.model.is_gradient_checkpointing == (ep > 1)
    batch, advantages = step_batch(cfg)
    metrics = [backend.train_step(batch, advantages) for _ in range(2)]
    state = backend.full_state_dict()
    if rank == 0:
        rollout = hf_manifest(meta_policy_model(cfg.policy, len(backend.tokenizer), cfg.run.seed))
        torch.save({"state": state, "metrics": metrics, "meshes": meshes,
                    "digests": (Manifest.of(state).digest, rollout.digest)}, out)


@pytest.mark.parametrize("model, world", [("qwen3_moe", 2), ("qwen3_moe", 4), ("nemotron_h", 2)])
def test_ranks_with_the_experts_split_train_as_fsdp2_alone_does(tmp_path, model, world):
    """world 4: two EP groups, each expert sharded over two ranks (efsdp)."""
    if model == "nemotron_h":
        nemotron_h_checkpoint(tmp_path / "nemotron_h")
        overrides = [f"policy.model_name={tmp_path / 'nemotron_h'}"]
    else:
        overrides = ["policy.tiny.architecture=qwen3_moe"]
    split, whole = str(tmp_path / "ep2.pt"), str(tmp_path / "ep1.pt")
    run_ranks(world, _train, split, overrides, 2)
    run_ranks(world, _train, whole, overrides, 1)
    a, b = torch.load(split), torch.load(whole)
    assert a["meshes"] == {("efsdp", "ep")} and b["meshes"] == {("dp",)}, (a["meshes"], b["meshes"])
    assert a["digests"][0] == a["digests"][1]
    # SGD: a gradient off by any factor moves the weights by it
    assert_trained_alike(a, b, atol=2e-6, metrics=("loss", "grad_norm", "kl_penalty", "probs_ratio_max"))


def _build(rank: int) -> None:
    FSDP2Backend(config("policy.expert_parallel_size=2"), init_distributed(120))  # the tiny llama: dense, no experts


def test_a_model_without_an_expert_parallel_plan_is_refused_at_start_with_its_type():
    with pytest.raises(Exception, match="transformers has no expert-parallel plan with token dispatch for llama"):
        run_ranks(2, _build)


@pytest.mark.parametrize("overrides", [
    ["policy.expert_parallel_size=2", "policy.tensor_parallel_size=2"],
    ["policy.expert_parallel_size=2", "policy.lora_cfg.enabled=true"],
    ["policy.expert_parallel_size=2", "policy.megatron_cfg.enabled=true"]])
def test_expert_parallelism_with_what_it_is_not_built_with_is_refused(overrides):
    with pytest.raises(ConfigError, match="expert_parallel_size > 1 is the FSDP2 backend's"):
        load_config(None, overrides)
