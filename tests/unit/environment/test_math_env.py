"""The math environment scores with math_verify as NeMo RL does, and never raises for one episode."""

import threading

import pytest
from math_verify.errors import TimeoutException

from services.environment.envs import math as math_env
from services.environment.envs.math import MathEnvironment


def ask(env, response, ground_truth, **kwargs):
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": response}]
    return env.step([conversation], [{"ground_truth": ground_truth}], **kwargs)[0]


@pytest.fixture(scope="module")
def env():
    env = MathEnvironment(num_workers=1)
    yield env
    env.close()


def ask_from_worker_thread(env, response, ground_truth):
    """As the servicer calls it: from a thread that is not the main thread (verified in worker processes)."""
    results = []
    worker = threading.Thread(target=lambda: results.append(ask(env, response, ground_truth)))
    worker.start()
    worker.join()
    return results[0]


EQUIVALENT = [
    ("4", "2 + 2 = \\boxed{4}"),
    ("\\boxed{12}", "\\boxed{12}"),  # an already boxed ground truth still matches
    ("4.0", "\\boxed{\\frac{8}{2}}"),
    ("0.5", "The answer is $\\boxed{\\frac{1}{2}}$"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}"),
    ("\\frac{1}{2}", "\\boxed{\\tfrac12}"),
    ("\\frac{1}{3}", "\\boxed{0.333333}"),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
    ("\\sqrt{2}", "\\boxed{\\frac{\\sqrt{8}}{2}}"),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{1}{2}\\sqrt{3}}"),
    ("10^{3}", "\\boxed{1000}"),
    ("1000", "\\boxed{1,000}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("x=2", "\\boxed{2}"),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3, 2, 1\\}}"),
    ("(0, 1]", "\\boxed{(0,1]}"),
    ("(-\\infty, 0)", "\\boxed{(-\\infty,0)}"),
    ("5", "\\boxed{5 \\text{ cm}}"),
    ("5", "\\boxed{5\\,\\mathrm{cm}}"),
    ("50\\%", "\\boxed{0.5}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("4", "The answer is 4."),
]

NOT_EQUIVALENT = [
    ("12", "3 * 4 = 13"),
    ("2", "\\boxed{3}"),
    ("-1", "\\boxed{1}"),
    ("x^2", "\\boxed{x^3}"),
    ("\\frac{1}{3}", "\\boxed{0.33}"),
    ("\\pi", "\\boxed{3.14}"),
    ("(0, 1]", "\\boxed{[0,1]}"),
    ("[0, 1)", "\\boxed{(0,1]}"),
    ("\\{1, 2\\}", "\\boxed{\\{1, 2, 3\\}}"),
    ("4", "no answer here"),
    ("4", ""),
]


@pytest.mark.parametrize(("ground_truth", "response"), EQUIVALENT)
def test_equivalent_answers_score_one(env, ground_truth, response):
    result = ask(env, response, ground_truth)
    assert (result.reward, result.observation, result.terminated, result.error) == (
        1.0, "Environment: correct", True, "")


@pytest.mark.parametrize(("ground_truth", "response"), NOT_EQUIVALENT)
def test_different_answers_score_zero(env, ground_truth, response):
    result = ask(env, response, ground_truth)
    assert (result.reward, result.observation, result.terminated) == (0.0, "Environment: incorrect", True)


@pytest.mark.parametrize(("ground_truth", "response", "reward"), [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0), ("5", "\\boxed{5 \\text{ cm}}", 1.0), ("2", "\\boxed{3}", 0.0)])
def test_worker_thread_scores_like_the_main_thread(env, ground_truth, response, reward):
    result = ask_from_worker_thread(env, response, ground_truth)
    assert (result.reward, result.error) == (reward, "")


def test_pathological_response_from_a_worker_thread_is_bounded_by_the_verifier_alarm(env):
    # Without math_verify's alarm (unavailable off the main thread) sympy never returns on this one.
    assert ask_from_worker_thread(env, "\\boxed{9^{9^{9^{9}}}}", "4").reward == 0.0


def test_multiple_assistant_messages_are_concatenated(env):
    conversation = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "So the sum is \\boxed{4}"},
        {"role": "environment", "content": "Environment: incorrect"},
        {"role": "assistant", "content": "I stand by it."},
    ]
    assert env.step([conversation], [{"ground_truth": "4"}])[0].reward == 1.0


def test_only_assistant_messages_are_scored(env):
    conversation = [{"role": "user", "content": "Is it \\boxed{4}?"},
                    {"role": "assistant", "content": "no idea"}]
    assert env.step([conversation], [{"ground_truth": "4"}])[0].reward == 0.0


def test_verifier_timeout_scores_zero_without_raising(env, monkeypatch):
    def times_out(golds, preds):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(math_env, "_metric", times_out)
    result = ask(env, "\\boxed{4}", "4")
    assert (result.reward, result.observation, result.terminated) == (0.0, "Environment: incorrect", True)
    assert result.error == "verifier timeout"


def test_verifier_exception_scores_zero_and_leaves_other_episodes_alone(env, monkeypatch):
    real = math_env._metric

    def crashes_on_seven(golds, preds):
        if "7" in preds[0]:
            raise RuntimeError("sympy exploded")
        return real(golds, preds)

    monkeypatch.setattr(math_env, "_metric", crashes_on_seven)
    conversations = [[{"role": "assistant", "content": f"\\boxed{{{x}}}"}] for x in (7, 4)]
    bad, good = env.step(conversations, [{"ground_truth": "7"}, {"ground_truth": "4"}])
    assert (bad.reward, bad.observation) == (0.0, "Environment: incorrect")
    assert "sympy exploded" in bad.error
    assert (good.reward, good.error) == (1.0, "")


def test_missing_ground_truth_fails_only_that_episode(env):
    conversations = [[{"role": "assistant", "content": "\\boxed{4}"}]] * 2
    missing, present = env.step(conversations, [{}, {"ground_truth": "4"}])
    assert missing.reward == 0.0 and "ground_truth" in missing.error
    assert present.reward == 1.0


def test_extracted_answer_is_returned_only_when_asked(env):
    assert ask(env, "\\boxed{\\frac{1}{2}}", "0.5", return_extracted_answer=True).answer == "1/2"
    assert ask(env, "\\boxed{\\frac{1}{2}}", "0.5").answer is None
    assert ask(env, "no answer here", "4", return_extracted_answer=True).answer is None


def test_mismatched_batch_lengths_raise(env):
    with pytest.raises(ValueError, match="metadata"):
        env.step([[{"role": "assistant", "content": "4"}]], [])
