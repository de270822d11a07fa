"""token_logprobs, whole or in chunks of positions, against the plain float64 log-softmax: values and gradients."""

import pytest
import torch

from services.common.modeling import token_logprobs


def plain(logits, tokens, temperature):
    return torch.log_softmax(logits.double() / temperature, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk", [None, 1, 4, 7, 50])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_the_plain_log_softmax(chunk, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 11, 40)).requires_grad_()
    tokens = torch.randint(0, 40, (3, 11))
    weights = torch.randn(3, 11)
    ours = token_logprobs(logits, tokens, temperature, chunk)
    ref = plain(logits, tokens, temperature)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights.double()).sum(), logits)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-6)


def test_bf16_logits_are_scored_in_float32_and_get_a_bf16_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 30).bfloat16().requires_grad_()
    tokens = torch.randint(0, 30, (2, 5))
    ours = token_logprobs(logits, tokens, chunk=2)
    torch.testing.assert_close(ours.double(), plain(logits.float(), tokens, 1.0), rtol=0, atol=1e-6)
    ours.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.abs().sum() > 0


def test_a_slice_of_the_model_output_gets_its_gradient_in_place():
    """The trainer scores logits[:, :-1], a view: the gradient must land on the right positions of the whole."""
    logits = torch.randn(2, 6, 10, requires_grad=True)
    tokens = torch.randint(0, 10, (2, 5))
    token_logprobs(logits[:, :-1], tokens, chunk=2).sum().backward()
    expected = torch.autograd.grad(plain(logits[:, :-1], tokens, 1.0).sum(), logits)[0]
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=2e-6)
    assert logits.grad[:, -1].abs().sum() == 0
