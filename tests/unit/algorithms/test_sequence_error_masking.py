"""grpo.seq_logprob_error_threshold's mask and metrics against a per-sequence float64 loop written from NeMo RL's
definition (compute_and_apply_seq_logprob_error_masking)."""

import pytest
import torch

from services.trainer.algorithms import mask_by_sequence_error


def _reference(prev, gen, token_mask, sample_mask, rewards, threshold):
    errors, kept = {}, []
    for i in range(len(sample_mask)):
        tokens = [t for t in range(prev.shape[1]) if token_mask[i, t] * sample_mask[i] > 0]
        if tokens:
            errors[i] = sum(float(torch.exp((gen[i, t] - prev[i, t]).abs().double())) for t in tokens) / len(tokens)
        keep = sample_mask[i] > 0 and (errors.get(i, 1.0) <= threshold)  # no loss token: error 0, kept
        kept.append(1.0 if keep else 0.0)
    masked = [i for i in range(len(sample_mask)) if sample_mask[i] > 0 and not kept[i]]
    after = [errors[i] for i in errors if kept[i]]
    stats = lambda xs, suffix: {f"max_seq_mult_prob_error{suffix}": max(xs, default=0.0),
                                f"mean_seq_mult_prob_error{suffix}": sum(xs) / len(xs) if xs else 0.0,
                                f"min_seq_mult_prob_error{suffix}": min(xs, default=0.0)}
    metrics = {"num_masked_seqs_by_logprob_error": float(len(masked)),
               "masked_correct_pct": sum(float(rewards[i]) == 1 for i in masked) / len(masked) if masked else 0.0,
               **stats(list(errors.values()), ""), **stats(after, "_after_mask")}
    return torch.tensor(kept), metrics


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("threshold", [1.0, 1.5, 3.0, 100.0])
def test_the_mask_and_metrics_match_nemo_rls_definition(seed, threshold):
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 9
    prev = -torch.rand(b, t, generator=g) * 3
    gen = prev + torch.randn(b, t, generator=g) * 0.6
    token_mask = (torch.rand(b, t, generator=g) > 0.3).float()
    token_mask[0] = 0  # a sequence with no loss token
    sample_mask = (torch.rand(b, generator=g) > 0.2).float()
    rewards = (torch.rand(b, generator=g) > 0.5).float()
    kept, metrics = mask_by_sequence_error(prev, gen, token_mask, sample_mask, rewards, threshold)
    want_kept, want = _reference(prev, gen, token_mask, sample_mask, rewards, threshold)
    assert torch.equal(kept, want_kept)
    assert metrics.keys() == want.keys()
    for name, value in want.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_a_threshold_masks_only_sequences_above_it_and_never_revives_a_masked_one():
    prev = torch.zeros(3, 2)
    gen = torch.tensor([[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]])  # errors 1, e^2, 1
    kept, metrics = mask_by_sequence_error(prev, gen, torch.ones(3, 2), torch.tensor([1.0, 1.0, 0.0]),
                                           torch.tensor([0.0, 1.0, 1.0]), threshold=2.0)
    assert kept.tolist() == [1.0, 0.0, 0.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 1 and metrics["masked_correct_pct"] == 1.0
