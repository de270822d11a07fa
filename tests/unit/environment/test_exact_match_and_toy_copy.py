"""exact_match compares normalised answers; toy_copy rewards copying the prompt's digit."""

import pytest

from services.environment.envs.exact_match import ExactMatchEnvironment, extract_answer
from services.environment.envs.toy_copy import DIGITS, ToyCopyEnvironment


def reply(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize(("response", "ground_truth", "reward"), [
    ("Paris", "paris", 1.0),
    ("  New   York\n", "new york", 1.0),
    ("The capital is <answer> PARIS </answer>.", "Paris", 1.0),
    ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}", 1.0),
    ("<answer>Rome</answer> or \\boxed{Paris}", "Rome", 1.0),
    ("Paris!", "Paris", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),
    ("", "x", 0.0),
])
def test_exact_match_scores_normalised_answers(response, ground_truth, reward):
    result = ExactMatchEnvironment().step([reply(response)], [{"ground_truth": ground_truth}])[0]
    assert (result.reward, result.terminated, result.error) == (reward, True, "")


def test_exact_match_uses_the_last_assistant_message():
    conversation = reply("Paris") + [{"role": "environment", "content": "try again"},
                                     {"role": "assistant", "content": "Rome"}]
    assert ExactMatchEnvironment().step([conversation], [{"ground_truth": "Rome"}])[0].reward == 1.0


def test_extract_answer_handles_nested_and_unbalanced_boxes():
    assert extract_answer("\\boxed{a} then \\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert extract_answer("\\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("\\boxed{ok} \\boxed{broken") == "ok"


def test_exact_match_missing_ground_truth_fails_only_that_episode():
    results = ExactMatchEnvironment().step([reply("a"), reply("a")], [{}, {"ground_truth": "A"}])
    assert results[0].reward == 0.0 and results[0].error
    assert results[1].reward == 1.0


@pytest.mark.parametrize(("response", "reward", "answer"), [
    ("7", 1.0, "7"), ("  7 and more", 1.0, "7"), ("\n7", 1.0, "7"),
    ("77", 1.0, "7"), ("x7", 0.0, "x"), ("", 0.0, None), ("   ", 0.0, None), ("8", 0.0, "8"),
])
def test_toy_copy_rewards_the_first_non_space_character(response, reward, answer):
    env = ToyCopyEnvironment()
    result = env.step([reply(response)], [{"ground_truth": "7"}], return_extracted_answer=True)[0]
    assert (result.reward, result.answer, result.terminated) == (reward, answer, True)


def test_toy_copy_prompts_ask_to_copy_their_ground_truth_digit():
    rows = ToyCopyEnvironment().prompts(50, seed=1, offset=0)
    assert len(rows) == 50
    for row in rows:
        (message,) = row["messages"]
        digit = row["metadata"]["ground_truth"]
        assert message == {"role": "user", "content": f"copy {digit}"}
        assert digit in [str(d) for d in range(DIGITS)]
    assert len({row["metadata"]["ground_truth"] for row in rows}) == DIGITS


def test_toy_copy_prompts_are_reproducible_for_the_same_seed_and_offset():
    env = ToyCopyEnvironment()
    assert env.prompts(20, seed=4, offset=100) == env.prompts(20, seed=4, offset=100)
    assert env.prompts(20, seed=4, offset=100)[5:] == env.prompts(15, seed=4, offset=105)
    assert env.prompts(20, seed=4, offset=100) != env.prompts(20, seed=5, offset=100)


def test_environments_without_generated_prompts_return_none():
    assert ExactMatchEnvironment().prompts(3, seed=0, offset=0) is None
