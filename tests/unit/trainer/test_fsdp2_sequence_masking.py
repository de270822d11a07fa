"""grpo.seq_logprob_error_threshold in the FSDP2 trainer: the samples it masks leave the step exactly as samples
with sample_mask 0 do, and the mask and metrics are the same on every rank (test_fsdp2_ranks.py, its seq_mask case)."""

import torch
from trainer_harness import config, run_ranks, step_batch

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

THRESHOLD = "grpo.seq_logprob_error_threshold=20"
"""The harness's engine logprobs are random, so per-sample errors spread around it (9 to 69 here)."""


def _step(rank: int, out: str, overrides: list[str], sample_mask: list[float] | None) -> None:
    backend = FSDP2Backend(config(*overrides), init_distributed(120))
    batch, advantages = step_batch(backend.cfg)
    if sample_mask is not None:
        batch.sample_mask = torch.tensor(sample_mask)
    lengths = batch.attention_mask.sum(1).tolist()
    masked, _ = backend._mask_by_sequence_error(batch, lengths, None)
    metrics = backend.train_step(batch, advantages)
    torch.save({"state": backend.full_state_dict(), "metrics": metrics, "mask": masked.sample_mask.tolist()}, out)


def test_masked_samples_leave_the_step_as_samples_with_sample_mask_zero(tmp_path):
    by_threshold, by_hand = str(tmp_path / "threshold.pt"), str(tmp_path / "hand.pt")
    run_ranks(1, _step, by_threshold, [THRESHOLD], None)
    a = torch.load(by_threshold)
    masked = a["metrics"]["num_masked_seqs_by_logprob_error"]
    assert 0 < masked < len(a["mask"]) and sum(a["mask"]) == len(a["mask"]) - masked
    assert a["metrics"]["max_seq_mult_prob_error_after_mask"] <= 20 < a["metrics"]["max_seq_mult_prob_error"]
    run_ranks(1, _step, by_hand, [], a["mask"])  # no threshold: the same rows dropped by sample_mask
    b = torch.load(by_hand)
    assert "num_masked_seqs_by_logprob_error" not in b["metrics"]
    for name, value in a["state"].items():
        assert torch.equal(b["state"][name], value), name
    assert b["metrics"]["loss"] == a["metrics"]["loss"]
