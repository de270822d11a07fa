"""The trajectory builder against a slow reference that derives each sample from its chain of calls."""

from __future__ import annotations

import random

import pytest

from services.rollout.endpoint.trajectory import Call, Choice, Sample, TrajectoryBuilder, group_rows


def choice(tokens: list[int], version: int = 0, truncated: bool = False, flaws: int = 0) -> Choice:
    return Choice(token_ids=tokens, logprobs=[-0.5 - t / 100 for t in tokens],
                  versions=[version] * len(tokens), truncated=truncated, flaws=flaws)


def reference(calls: list[Call]) -> tuple[list[Sample], int]:
    """Each sample is a chain of (call, choice) entries; its tokens are the last entry's prompt + choice, and
    a position is generated exactly when some entry of the chain sampled it."""
    chains: list[list[tuple[int, int]]] = []
    mismatches = 0

    def seq(k: int, j: int) -> list[int]:
        return calls[k].prompt_ids + calls[k].choices[j].token_ids

    for k, call in enumerate(calls):
        parent = None
        for c, chain in enumerate(chains):
            live = seq(*chain[-1])
            is_prefix = len(live) <= len(call.prompt_ids) and all(
                live[i] == call.prompt_ids[i] for i in range(len(live)))
            if is_prefix and (parent is None or len(live) > len(seq(*chains[parent][-1]))):
                parent = c
        if parent is None:
            mismatches += bool(chains)
            chains += [[(k, j)] for j in range(len(call.choices))]
        else:
            base = chains[parent]
            chains[parent] = base + [(k, 0)]
            chains += [base + [(k, j)] for j in range(1, len(call.choices))]
    samples = []
    for chain in chains:
        tokens = seq(*chain[-1])
        s = Sample(token_ids=tokens, generated_mask=[False] * len(tokens), logprobs=[0.0] * len(tokens),
                   versions=[-1] * len(tokens), flaws=[0] * len(tokens), calls=len(chain))
        for k, j in chain:
            start, ch = len(calls[k].prompt_ids), calls[k].choices[j]
            for i, t in enumerate(ch.token_ids):
                s.generated_mask[start + i] = True
                s.logprobs[start + i] = ch.logprobs[i]
                s.versions[start + i] = ch.versions[i]
                s.flaws[start + i] = ch.flaws
            s.truncated |= ch.truncated
        samples.append(s)
    return samples, mismatches


def random_calls(rng: random.Random, n: int) -> list[Call]:
    """Calls that mostly extend an earlier state (prompt + choice), sometimes a stale or perturbed one."""
    states: list[list[int]] = []
    calls = []
    for _ in range(n):
        r = rng.random()
        if states and r < 0.6:
            prompt = list(rng.choice(states[-3:]))
        elif states and r < 0.8:
            prompt = list(rng.choice(states))
            if prompt and rng.random() < 0.5:
                prompt[rng.randrange(len(prompt))] = rng.randrange(4)  # a re-tokenized turn
        else:
            prompt = []
        prompt += [rng.randrange(4) for _ in range(rng.randrange(0, 4))] or [1]
        choices = [choice([rng.randrange(4) for _ in range(rng.randrange(0, 4))], version=rng.randrange(3),
                          truncated=rng.random() < 0.2, flaws=rng.choice([0, 0, 1, 2, 3]))
                   for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        calls.append(Call(prompt_ids=prompt, choices=choices))
        states += [prompt + c.token_ids for c in choices]
    return calls


@pytest.mark.parametrize("seed", range(300))
def test_builder_matches_the_chain_reference_on_random_episodes(seed):
    calls = random_calls(random.Random(seed), n=random.Random(seed).randrange(1, 12))
    builder = TrajectoryBuilder()
    for call in calls:
        builder.add(call)
    want, mismatches = reference(calls)
    assert builder.trajectory.samples == want
    assert builder.trajectory.new_samples == mismatches
    assert builder.trajectory.calls == len(calls)


def test_two_turns_that_extend_make_one_sample_with_only_sampled_tokens_trainable():
    b = TrajectoryBuilder()
    assert b.add(Call(prompt_ids=[1, 5, 6], choices=[choice([7, 2])]))
    assert b.add(Call(prompt_ids=[1, 5, 6, 7, 2, 9, 9], choices=[choice([8], version=1)]))
    [s] = b.trajectory.samples
    assert s.token_ids == [1, 5, 6, 7, 2, 9, 9, 8]
    assert s.generated_mask == [False, False, False, True, True, False, False, True]
    assert s.logprobs == pytest.approx([0.0, 0.0, 0.0, -0.57, -0.52, 0.0, 0.0, -0.58])
    assert s.versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert (s.version_start, s.version_end, s.calls) == (0, 1, 2)


def test_a_rewritten_history_starts_a_sample_of_its_own_and_is_counted():
    b = TrajectoryBuilder()
    b.add(Call(prompt_ids=[1, 5], choices=[choice([7, 2])]))
    assert not b.add(Call(prompt_ids=[1, 5, 7, 3, 9], choices=[choice([8])]))  # turn 1 came back as 7 3
    first, second = b.trajectory.samples
    assert first.token_ids == [1, 5, 7, 2] and second.token_ids == [1, 5, 7, 3, 9, 8]
    assert second.generated_mask == [False] * 5 + [True]
    assert b.trajectory.new_samples == 1


def test_n_choices_fork_the_sample_they_extend():
    b = TrajectoryBuilder()
    b.add(Call(prompt_ids=[1], choices=[choice([4])]))
    b.add(Call(prompt_ids=[1, 4, 9], choices=[choice([5]), choice([6])]))
    assert [s.token_ids for s in b.trajectory.samples] == [[1, 4, 9, 5], [1, 4, 9, 6]]
    assert [s.generated_mask for s in b.trajectory.samples] == [[False, True, False, True]] * 2
    assert b.trajectory.new_samples == 0


def test_group_rows_share_the_longest_common_ungenerated_prefix_as_the_prompt():
    b = TrajectoryBuilder()
    b.add(Call(prompt_ids=[1, 5, 6], choices=[choice([7, 2]), choice([5, 3])]))  # the second samples a 5 too
    prompt, rows = group_rows(b.trajectory.samples)
    assert prompt == [1, 5, 6]
    assert [r["token_ids"] for r in rows] == [[7, 2], [5, 3]]
    assert [r["generated_mask"] for r in rows] == [[True, True]] * 2
    assert rows[0]["generation_logprobs"] == b.trajectory.samples[0].logprobs[3:]
    assert (rows[0]["version_start"], rows[0]["version_end"]) == (0, 0)
    same, _ = group_rows([Sample(token_ids=[4], generated_mask=[True], logprobs=[-1.0], versions=[0])] * 2)
    assert same == []  # a generated token is never prompt


def test_an_episode_without_calls_keeps_the_others_prompt_and_gives_an_empty_completion():
    b = TrajectoryBuilder()
    b.add(Call(prompt_ids=[1, 5, 6], choices=[choice([7, 2]), choice([5, 3])]))
    prompt, rows = group_rows([b.trajectory.samples[0], Sample(), b.trajectory.samples[1]])
    assert prompt == [1, 5, 6]
    assert [r["token_ids"] for r in rows] == [[7, 2], [], [5, 3]]


@pytest.mark.parametrize("seed", range(50))
def test_group_rows_rebuild_every_sample(seed):
    calls = random_calls(random.Random(seed), n=6)
    b = TrajectoryBuilder()
    for call in calls:
        b.add(call)
    prompt, rows = group_rows(b.trajectory.samples)
    for sample, row in zip(b.trajectory.samples, rows, strict=True):
        assert prompt + row["token_ids"] == sample.token_ids
        assert [False] * len(prompt) + row["generated_mask"] == sample.generated_mask
        assert [0] * len(prompt) + (row["flaws"] or [0] * len(row["token_ids"])) == sample.flaws


def test_a_flawed_replys_tokens_carry_its_flaws_and_rows_without_one_carry_none():
    b = TrajectoryBuilder()
    b.add(Call(prompt_ids=[1, 5], choices=[choice([7, 2], flaws=1), choice([3])]))
    b.add(Call(prompt_ids=[1, 5, 7, 2, 9], choices=[choice([8], flaws=2)]))
    flawed, sound = b.trajectory.samples
    assert flawed.flaws == [0, 0, 1, 1, 0, 2]
    _, rows = group_rows([flawed, sound])
    assert [r["flaws"] for r in rows] == [[1, 1, 0, 2], []]  # empty, as the proto's field, when all are 0
