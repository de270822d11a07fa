"""math_multi_reward's three components, as NeMo RL's HFMultiRewardVerifyWorker scores them."""

import pytest

from services.environment.base import make_environment


def _step(response: str, truth: str = "42"):
    env = make_environment("math_multi_reward", {"math_multi_reward": {"num_workers": 8}})
    (result,) = env.step([[{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]],
                         [{"ground_truth": truth}], return_extracted_answer=True)
    return result


@pytest.mark.parametrize("response, correctness, integer, fmt", [
    ("<think>6*7</think>\n<answer>42</answer>", 1.0, 1.0, 1.0),
    ("<think>x</think>\n<answer> 41 </answer>", 0.0, 1.0, 1.0),
    ("the answer is <answer>42</answer>", 1.0, 1.0, 0.0),
    ("<think>a</think>\n<answer>4.2</answer>", 0.0, 0.0, 1.0),
    ("<think>a</think>\n<answer>42</answer><answer>42</answer>", 1.0, 1.0, 0.0),
    ("42", 1.0, 1.0, 0.0),  # no tag: the whole response is the answer, as in NeMo RL
])
def test_each_component_and_their_sum(response, correctness, integer, fmt):
    r = _step(response)
    assert r.named_rewards == {"reward/correctness": correctness, "reward/integer": integer, "reward/format": fmt}
    assert r.reward == correctness + integer + fmt
    assert r.observation == ("Environment: correct" if correctness else "Environment: incorrect")


def test_a_bad_episode_fails_alone_and_another_impl_is_refused():
    env = make_environment("math_multi_reward")
    bad, good = env.step([[{"role": "assistant", "content": "1"}]] * 2, [{}, {"ground_truth": "1"}])
    assert bad.error and bad.reward == 0.0 and good.reward == 2.0
    with pytest.raises(ValueError, match="hf_math_verify only"):
        make_environment("math_multi_reward", {"math_multi_reward": {"math_verify_impl": "dapo_math_verify"}})
