"""env.math.math_verify_impl=dapo_math_verify: DAPO's "Answer: ..." check of normalized strings, from any thread."""

from __future__ import annotations

import threading

import pytest

from services.common.config import load_config
from services.environment.envs.dapo_math import dapo_verify, normalize
from services.environment.envs.math import MathEnvironment


@pytest.mark.parametrize("response, ground_truth", [
    ("Reasoning...\nAnswer: 204", "204"),
    ("answer:   $\\frac{1}{2}$", "\\frac12"),  # case, spaces, $...$, and \frac shorthand
    ("Answer: 1,000 dollars", "1000"),  # units and thousands separators
    ("Answer: x = 7", "7"),  # what follows the last "="
    ("Answer: 3\nsome words\nAnswer: \\boxed{5}", "5"),  # the last Answer line, unboxed
    ("Answer: 90^\\circ", "90"),
])
def test_an_equal_answer_scores_one_and_is_reported_normalized(response, ground_truth):
    reward, prediction = dapo_verify(response, ground_truth)
    assert reward == 1.0 and prediction == normalize(ground_truth)


@pytest.mark.parametrize("response, ground_truth", [
    ("The answer is 204", "204"),  # no "Answer:" line
    ("Answer: 0.5", "\\frac{1}{2}"),  # strings, not values: DAPO does not evaluate
    ("Answer: 204" + " padding" * 50, "204"),  # the line is not in the last 300 characters
    ("Answer: 205", "204"),
])
def test_anything_else_scores_zero(response, ground_truth):
    assert dapo_verify(response, ground_truth)[0] == 0.0


def test_the_math_environment_uses_it_when_configured_on_any_thread_without_workers():
    assert load_config(None, ["env.math.math_verify_impl=dapo_math_verify"]).env.math.math_verify_impl == \
        "dapo_math_verify"
    env = MathEnvironment(num_workers=1, math_verify_impl="dapo_math_verify")
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Answer: \\boxed{42}"}]
    results = []
    worker = threading.Thread(target=lambda: results.extend(env.step([conversation, conversation],
                              [{"ground_truth": "42"}, {"ground_truth": "41"}], return_extracted_answer=True)))
    worker.start()
    worker.join()
    assert [(r.reward, r.answer) for r in results] == [(1.0, "42"), (0.0, "42")]
    assert env._pool is None  # no verifier processes: the check is pure string work
    with pytest.raises(ValueError, match="math_verify_impl"):
        MathEnvironment(math_verify_impl="sympy")
