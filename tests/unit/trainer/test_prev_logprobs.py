"""A batch trained in one optimizer step takes prev logprobs from its own forward instead of a second pass:
the update must be the one a recomputed prev gives."""

import torch
from trainer_harness import assert_trained_alike, config, run_ranks, step_batch

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

# Rewards, generation logprobs far from the policy's, truncated importance sampling and a KL term: every
# place prev enters the loss and its metrics.
OVERRIDES = ["policy.train_micro_batch_size=5", "loss_fn.reference_policy_kl_penalty=0.05",
             "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
             "loss_fn.truncated_importance_sampling_ratio=2.0"]


class RecomputingBackend(FSDP2Backend):
    """What the trainer did before: a no-grad forward for prev, whatever the number of optimizer steps."""

    def _prev_logprobs(self, b, lengths, num_updates):
        return self._all_logprobs(self.model, b, lengths)


def _train_twice(rank: int, out: str, recompute: bool) -> None:
    cfg = config(*OVERRIDES)
    backend = (RecomputingBackend if recompute else FSDP2Backend)(cfg, init_distributed(120))
    batch, advantages = step_batch(cfg)
    metrics = [backend.train_step(batch, advantages) for _ in range(2)]  # the second from moved weights
    torch.save({"state": backend.full_state_dict(), "metrics": metrics}, out)


def test_one_optimizer_step_from_its_own_forward_updates_the_weights_as_a_recomputed_prev_does(tmp_path):
    skipped, recomputed = str(tmp_path / "skipped.pt"), str(tmp_path / "recomputed.pt")
    run_ranks(1, _train_twice, skipped, False)
    run_ranks(1, _train_twice, recomputed, True)
    a, b = torch.load(skipped), torch.load(recomputed)
    assert_trained_alike(a, b, atol=1e-5, metrics=("loss", "probs_ratio_min", "probs_ratio_max", "grad_norm",
                                                   "kl_penalty", "token_mult_prob_error", "is_oob_ratio"))
