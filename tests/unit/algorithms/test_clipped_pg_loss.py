"""clipped_pg_loss against a slow, token-by-token float64 reference: values, metrics and gradients."""

import math

import pytest
import torch

from services.common.config import LossConfig
from services.trainer.algorithms import LossInputs, clipped_pg_loss

F64 = torch.float64
EPS = 1e-8


def weight_or_zero(log_weight):
    """exp(log_weight) as a float, with overflow and NaN mapped to 0 like nan_to_num."""
    try:
        value = math.exp(log_weight)
    except OverflowError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def kl_estimate(kind, logr):
    if kind == "k1":
        return -logr
    if kind == "k2":
        return logr * logr / 2
    return torch.exp(logr) - 1 - logr


def reference_ratios(lp_row, prev_row, tmask, cfg):
    """(r, r_clip) per token of one response, as lists of scalar tensors."""
    if cfg.force_on_policy_ratio:
        ratios = [torch.exp(x - x.detach()) for x in lp_row]
        return ratios, ratios
    if cfg.disable_ppo_ratio:
        return list(lp_row), list(lp_row)
    if cfg.sequence_level_importance_ratios:
        mean_log = sum(m * (x - p) for m, x, p in zip(tmask, lp_row, prev_row)) / (sum(tmask) + EPS)
        ratios = [torch.exp(mean_log)] * len(lp_row)
    else:
        ratios = [torch.exp(x - p) for x, p in zip(lp_row, prev_row)]
    return ratios, [torch.clamp(r, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max) for r in ratios]


def reference_weights(log_w, tmask, smask, cfg):
    """Truncated importance weights of one response (floats) and its out-of-bounds flags."""
    if cfg.sequence_level_importance_ratios:
        weights = [weight_or_zero(sum(m * smask * lw for m, lw in zip(tmask, log_w)))] * len(log_w)
    else:
        weights = [weight_or_zero(lw) for lw in log_w]
    kind = cfg.truncated_importance_sampling_type
    low = cfg.truncated_importance_sampling_ratio_min or 0.0
    high = cfg.truncated_importance_sampling_ratio
    if kind is None:
        return weights, [False] * len(log_w)
    if kind == "seq-mask-tis":
        geo_mean = math.exp(sum(m * lw for m, lw in zip(tmask, log_w)) / (sum(tmask) + EPS))
        outside = not (low <= geo_mean <= high)
        return [0.0 if outside else w for w in weights], [outside] * len(log_w)
    outside = [not (low <= w <= high) for w in weights]
    if kind == "tis":
        return [min(max(w, low), high) for w in weights], outside
    return [0.0 if o else w for o, w in zip(outside, weights)], outside


def reference_kl_token(lp, ref, gen, cfg):
    logr = ref - lp
    w = torch.exp(lp - gen) if cfg.use_on_policy_kl_approximation else torch.exp(lp - lp.detach())
    if not math.isfinite(float(w.detach())):
        w = torch.zeros((), dtype=F64)
    clamp = cfg.kl_input_clamp_value
    if clamp is not None and abs(float(logr.detach())) > clamp:
        logr = torch.clamp(logr, -clamp, clamp)
        w = w.detach()
    kl = w * kl_estimate(cfg.reference_policy_kl_type, logr)
    if cfg.kl_output_clamp_value is not None:
        kl = torch.clamp(kl, -cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return cfg.reference_policy_kl_penalty * kl


def reference_loss(lp, d: LossInputs, cfg: LossConfig, n_tok, n_seq):
    """Loop over responses and tokens with scalars only. Returns (loss, a few metrics)."""
    batch, length = lp.shape
    adv = d.advantages if d.advantages.dim() == 2 else d.advantages[:, None].expand(batch, length)
    beta = cfg.reference_policy_kl_penalty
    loss, kl_total = torch.zeros((), dtype=F64), torch.zeros((), dtype=F64)
    names = ["probs_ratio", "sampling_importance_ratio", "token_mult_prob_error", "gen_kl_error",
             "approx_entropy", "is_oob_ratio"]
    metrics = dict.fromkeys(names, 0.0)
    for i in range(batch):
        tmask = [float(m) for m in d.token_mask[i]]
        smask = float(d.sample_mask[i])
        lp_row = list(lp[i])
        prev = [x.detach() for x in lp_row] if cfg.force_on_policy_ratio else list(d.prev_logprobs[i])
        gen = list(d.generation_logprobs[i])
        log_w = [float(p - g) for p, g in zip(prev, gen)]
        ratios, clipped = reference_ratios(lp_row, prev, tmask, cfg)
        weights, outside = reference_weights(log_w, tmask, smask, cfg)
        if cfg.sequence_level_importance_ratios:
            metrics["sampling_importance_ratio"] += weights[0] * smask / (n_seq + EPS)
        if cfg.truncated_importance_sampling_type == "seq-mask-tis":
            metrics["is_oob_ratio"] += outside[0] * smask / (n_seq + EPS)
        seq_loss, seq_kl = torch.zeros((), dtype=F64), torch.zeros((), dtype=F64)
        for t in range(length):
            a, m = float(adv[i, t]), tmask[t] * smask
            if cfg.use_cispo:
                token_loss = -a * clipped[t].detach() * lp_row[t]
            else:
                token_loss = torch.maximum(-a * ratios[t], -a * clipped[t])
            if cfg.ratio_clip_c is not None and a < 0:
                token_loss = torch.minimum(token_loss, torch.tensor(-a * cfg.ratio_clip_c, dtype=F64))
            w = weights[t] if cfg.use_importance_sampling_correction else 1.0
            seq_loss = seq_loss + w * token_loss * tmask[t]
            if beta:
                kl = reference_kl_token(lp_row[t], d.reference_logprobs[i, t], gen[t], cfg)
                seq_kl = seq_kl + kl * tmask[t]
            x = float(lp_row[t].detach())
            metrics["probs_ratio"] += float(ratios[t].detach()) * m / (n_tok + EPS)
            metrics["token_mult_prob_error"] += math.exp(abs(log_w[t]) * m) * m / (n_tok + EPS)
            gen_kl = float(kl_estimate(cfg.reference_policy_kl_type, torch.tensor(log_w[t], dtype=F64)))
            metrics["gen_kl_error"] += gen_kl * m / (n_tok + EPS)
            metrics["approx_entropy"] -= math.exp(x - float(gen[t])) * x * m / (n_tok + EPS)
            if not cfg.sequence_level_importance_ratios:
                metrics["sampling_importance_ratio"] += weights[t] * m / (n_tok + EPS)
            if cfg.truncated_importance_sampling_type in ("tis", "icepop"):
                metrics["is_oob_ratio"] += outside[t] * m / (n_tok + EPS)
        if cfg.token_level_loss:
            scale = smask / (n_tok + EPS)
        else:
            scale = smask / (sum(tmask) + EPS) / (n_seq + EPS)
        loss, kl_total = loss + seq_loss * scale, kl_total + seq_kl * scale
    metrics["kl_penalty"] = float(kl_total.detach()) / beta if beta else 0.0
    return loss + kl_total, metrics


def random_inputs(seed, *, extreme=False, per_token_advantages=False, batch=4, length=6):
    g = torch.Generator().manual_seed(seed)
    prev = -1.0 - torch.rand(batch, length, generator=g, dtype=F64) * 2
    gen = prev + 0.3 * torch.randn(batch, length, generator=g, dtype=F64)
    curr = prev + 0.3 * torch.randn(batch, length, generator=g, dtype=F64)
    ref = curr + 0.5 * torch.randn(batch, length, generator=g, dtype=F64)
    if extreme:  # log-ratios of +-50 between every pair of policies
        signs = torch.where(torch.rand(batch, length, generator=g) < 0.5, -1.0, 1.0).to(F64)
        pick = torch.rand(batch, length, generator=g) < 0.4
        curr = torch.where(pick, prev + 50 * signs, curr)
        gen = torch.where(torch.rand(batch, length, generator=g) < 0.4, prev - 50 * signs, gen)
        ref = torch.where(torch.rand(batch, length, generator=g) < 0.4, curr + 50 * signs, ref)
    token_mask = torch.rand(batch, length, generator=g) < 0.75
    token_mask[0] = False  # one fully masked response
    sample_mask = torch.ones(batch, dtype=torch.bool)
    sample_mask[-1] = False
    shape = (batch, length) if per_token_advantages else (batch,)
    data = LossInputs(
        prev_logprobs=prev,
        generation_logprobs=gen,
        reference_logprobs=ref,
        advantages=torch.randn(*shape, generator=g, dtype=F64),
        token_mask=token_mask,
        sample_mask=sample_mask,
    )
    n_tok = float((token_mask & sample_mask[:, None]).sum())
    n_seq = float(sample_mask.sum())
    return curr, data, n_tok, n_seq


CONFIGS = {
    "ppo": dict(),
    "dapo_clip_higher_dual_clip": dict(ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=3.0),
    "no_is_correction": dict(use_importance_sampling_correction=False),
    "tis": dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2),
    "tis_min": dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2,
                    truncated_importance_sampling_ratio_min=0.9),
    "icepop": dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.3,
                   truncated_importance_sampling_ratio_min=0.8),
    "seq_mask_tis": dict(truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.1,
                         truncated_importance_sampling_ratio_min=0.9),
    "kl_k1": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1"),
    "kl_k2_no_clamps": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k2",
                            kl_input_clamp_value=None, kl_output_clamp_value=None),
    "kl_k3_tight_clamps": dict(reference_policy_kl_penalty=0.05, kl_input_clamp_value=0.4,
                               kl_output_clamp_value=0.3),
    "kl_on_policy_approximation": dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True),
    "sequence_level_loss": dict(token_level_loss=False, reference_policy_kl_penalty=0.1),
    "gspo": dict(token_level_loss=False, sequence_level_importance_ratios=True),
    "gspo_tis": dict(token_level_loss=False, sequence_level_importance_ratios=True,
                     truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.5),
    "force_on_policy_ratio": dict(force_on_policy_ratio=True, reference_policy_kl_penalty=0.1),
    "disable_ppo_ratio": dict(disable_ppo_ratio=True),
    "cispo": dict(use_cispo=True, ratio_clip_min=0.1, ratio_clip_max=0.1),
    "cispo_minimax_tis": dict(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=0.28,
                              truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2,
                              reference_policy_kl_penalty=0.1),
}


def loss_and_grad(fn, curr, *args):
    leaf = curr.clone().requires_grad_(True)
    loss, metrics = fn(leaf, *args)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def fast(leaf, data, cfg, n_tok, n_seq):
    return clipped_pg_loss(leaf, data, cfg, global_valid_tokens=n_tok, global_valid_seqs=n_seq)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_and_gradient_match_token_loop_reference(name, seed):
    cfg = LossConfig(**CONFIGS[name])
    curr, data, n_tok, n_seq = random_inputs(seed, per_token_advantages=seed == 1)
    loss, grad, metrics = loss_and_grad(fast, curr, data, cfg, n_tok, n_seq)
    ref_loss, ref_grad, ref_metrics = loss_and_grad(reference_loss, curr, data, cfg, n_tok, n_seq)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    for key, expected in ref_metrics.items():
        assert metrics.get(key, 0.0) == pytest.approx(expected, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("name", ["ppo", "dapo_clip_higher_dual_clip", "tis", "icepop", "kl_k3_tight_clamps",
                                  "kl_on_policy_approximation", "gspo", "sequence_level_loss", "cispo"])
def test_loss_and_gradient_match_reference_with_extreme_log_ratios(name):
    cfg = LossConfig(**CONFIGS[name])
    curr, data, n_tok, n_seq = random_inputs(7, extreme=True)
    loss, grad, _ = loss_and_grad(fast, curr, data, cfg, n_tok, n_seq)
    ref_loss, ref_grad, _ = loss_and_grad(reference_loss, curr, data, cfg, n_tok, n_seq)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_float32_inputs_agree_with_float64_reference():
    cfg = LossConfig(**CONFIGS["dapo_clip_higher_dual_clip"], reference_policy_kl_penalty=0.1)
    curr, data, n_tok, n_seq = random_inputs(3)
    fields = {name: getattr(data, name) for name in LossInputs.__slots__}
    as32 = LossInputs(**{name: x.float() if x.is_floating_point() else x for name, x in fields.items()})
    loss, grad, _ = loss_and_grad(fast, curr.float(), as32, cfg, n_tok, n_seq)
    ref_loss, ref_grad, _ = loss_and_grad(reference_loss, curr, data, cfg, n_tok, n_seq)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("token_level", [True, False])
def test_fully_masked_batch_gives_zero_loss_and_zero_gradient(token_level):
    cfg = LossConfig(token_level_loss=token_level, reference_policy_kl_penalty=0.1)
    curr, data, _, _ = random_inputs(0)
    data.token_mask = torch.zeros_like(data.token_mask)
    loss, grad, metrics = loss_and_grad(fast, curr, data, cfg, 0.0, 0.0)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert metrics["probs_ratio_min"] == float("inf") and metrics["probs_ratio_max"] == float("-inf")


def test_ratio_is_exactly_one_and_gradient_is_reinforce_when_policies_agree():
    cfg = LossConfig(reference_policy_kl_penalty=0.0)
    curr, data, n_tok, n_seq = random_inputs(5, per_token_advantages=True)
    data.prev_logprobs = curr.clone()
    data.generation_logprobs = curr.clone()
    loss, grad, metrics = loss_and_grad(fast, curr, data, cfg, n_tok, n_seq)
    mask = (data.token_mask & data.sample_mask[:, None]).to(F64)
    assert metrics["probs_ratio_min"] == 1.0 and metrics["probs_ratio_max"] == 1.0
    assert metrics["sampling_importance_ratio_max"] == 1.0

    def reinforce(leaf):
        return -(data.advantages * leaf * mask).sum() / (n_tok + EPS), {}

    _, reinforce_grad, _ = loss_and_grad(reinforce, curr)
    torch.testing.assert_close(grad, reinforce_grad, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(-(data.advantages * mask).sum().item() / (n_tok + EPS), rel=1e-12)


def test_clip_fractions_count_tokens_where_the_clip_cuts_the_gradient():
    cfg = LossConfig(ratio_clip_c=3.0, use_importance_sampling_correction=False)
    prev = torch.zeros(1, 4, dtype=F64)
    curr = torch.log(torch.tensor([[0.5, 1.5, 1.0, 4.0]], dtype=F64))
    advantages = torch.tensor([[-1.0, 1.0, 1.0, -1.0]])
    data = LossInputs(prev_logprobs=prev, generation_logprobs=prev, advantages=advantages,
                      token_mask=torch.ones(1, 4), sample_mask=torch.ones(1))
    _, grad, metrics = loss_and_grad(fast, curr, data, cfg, 4.0, 1.0)
    assert metrics["clip_fraction_low"] == pytest.approx(0.25)
    assert metrics["clip_fraction_high"] == pytest.approx(0.25)
    assert metrics["dual_clip_fraction"] == pytest.approx(0.25)
    assert grad[0].tolist()[:2] == [0.0, 0.0] and grad[0, 3].item() == 0.0 and grad[0, 2].item() != 0.0


def test_kl_penalty_without_reference_logprobs_is_an_error():
    curr, data, n_tok, n_seq = random_inputs(0)
    data.reference_logprobs = None
    with pytest.raises(ValueError, match="reference_logprobs"):
        clipped_pg_loss(curr, data, LossConfig(reference_policy_kl_penalty=0.1),
                        global_valid_tokens=n_tok, global_valid_seqs=n_seq)


@pytest.mark.parametrize("bad", [
    dict(truncated_importance_sampling_type="tis"),
    dict(truncated_importance_sampling_ratio=2.0),
    dict(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0),
    dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
         use_importance_sampling_correction=False),
    dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
         truncated_importance_sampling_ratio_min=3.0),
    dict(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=2.0,
         truncated_importance_sampling_ratio_min=0.5, sequence_level_importance_ratios=True,
         token_level_loss=False),
])
def test_inconsistent_truncation_config_is_rejected(bad):
    with pytest.raises(ValueError):
        LossConfig(**bad)


def test_cispo_keeps_the_gradient_of_a_token_that_the_ppo_clip_drops():
    """One token, A = 1, r = e^0.5 > 1 + 0.2: PPO's clipped term is constant there (no gradient), while CISPO
    still pushes the logprob up, weighted by the clipped ratio 1.2 (sg: the weight itself is not differentiated)."""
    curr = torch.tensor([[0.0]], dtype=F64)
    data = LossInputs(prev_logprobs=torch.tensor([[-0.5]], dtype=F64), generation_logprobs=torch.tensor([[-0.5]],
                      dtype=F64), advantages=torch.tensor([1.0], dtype=F64), token_mask=torch.tensor([[True]]),
                      sample_mask=torch.tensor([True]))
    _, ppo_grad, ppo_metrics = loss_and_grad(fast, curr, data, LossConfig(), 1.0, 1.0)
    _, cispo_grad, cispo_metrics = loss_and_grad(fast, curr, data, LossConfig(use_cispo=True), 1.0, 1.0)
    assert ppo_grad.item() == 0.0 and ppo_metrics["clip_fraction_high"] == pytest.approx(1.0)
    assert cispo_grad.item() == pytest.approx(-1.2) and cispo_metrics["clip_fraction_high"] == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [
    dict(disable_ppo_ratio=True), dict(force_on_policy_ratio=True), dict(ratio_clip_c=3.0),
    dict(token_level_loss=False), dict(token_level_loss=False, sequence_level_importance_ratios=True),
])
def test_cispo_with_an_option_that_would_change_or_void_it_is_rejected(bad):
    with pytest.raises(ValueError, match="use_cispo cannot be combined"):
        LossConfig(use_cispo=True, **bad)
