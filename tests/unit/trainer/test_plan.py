"""The micro-batch plan: every row trained once per step, by one rank, and every rank runs as many micro-batches."""

import pytest

from services.trainer.plan import logprob_plan, optimizer_steps, split_by_tokens, train_plan

LENGTHS = [5, 9, 2, 7, 7, 3, 11, 4, 6, 1, 8]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("global_batch,micro,budget", [(None, 2, None), (4, 3, None), (6, 1, 12), (None, 1, 10)])
def test_each_row_is_trained_once_and_ranks_run_the_same_number_of_micro_batches(world, global_batch, micro,
                                                                                   budget):
    plans = [train_plan(LENGTHS, r, world, global_batch=global_batch, micro=micro, budget=budget)
             for r in range(world)]
    for step, chunk in enumerate(optimizer_steps(len(LENGTHS), global_batch)):
        assert len({len(p[step]) for p in plans}) == 1, "ranks disagree on the number of micro-batches"
        rows = sorted(row for p in plans for mb in p[step] for row in mb)
        assert rows == list(chunk)
    lp = [logprob_plan(LENGTHS, r, world, global_batch=global_batch, micro=micro, budget=budget)
          for r in range(world)]
    assert len({len(p) for p in lp}) == 1
    assert sorted(row for p in lp for mb in p for row in mb) == list(range(len(LENGTHS)))
    for r in range(world):  # a rank's logprobs cover exactly the rows it trains on
        assert sorted(x for mb in lp[r] for x in mb) == sorted(x for s in plans[r] for mb in s for x in mb)


def test_token_budget_fills_greedily_and_a_long_row_goes_alone():
    assert split_by_tokens(range(5), [4, 4, 3, 20, 1], 10) == [[0, 1], [2], [3], [4]]
