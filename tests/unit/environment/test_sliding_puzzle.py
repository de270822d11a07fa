"""The sliding puzzle is a seeded multi-turn game: actions move tiles until solved or out of moves."""

from collections import deque

import pytest

from services.environment.envs.sliding_puzzle import (
    DIRECTIONS,
    SlidingPuzzleEnvironment,
    apply_action,
    solved_board,
)


def shortest_solution(board):
    """Breadth-first search over direction moves (the boards here are tiny)."""
    goal, start = solved_board(len(board)), tuple(map(tuple, board))
    queue, seen = deque([(start, [])]), {start}
    while queue:
        state, path = queue.popleft()
        if [list(row) for row in state] == goal:
            return path
        for action in DIRECTIONS:
            moved = apply_action([list(row) for row in state], action)
            if moved is not None and (key := tuple(map(tuple, moved))) not in seen:
                seen.add(key)
                queue.append((key, path + [action]))
    raise AssertionError("unsolvable board")


def play(env, prompt, actions):
    """Runs the multi-turn loop the rollout service runs, returning every turn's result."""
    conversation, metadata, results = list(prompt["messages"]), prompt["metadata"], []
    for action in actions:
        conversation.append({"role": "assistant", "content": f"I'll move. <action>{action}</action>"})
        result = env.step([conversation], [metadata])[0]
        results.append(result)
        conversation.append({"role": "environment", "content": result.observation})
        if result.terminated:
            break
        metadata = result.metadata
    return results


def test_scripted_actions_solve_a_seeded_puzzle():
    env = SlidingPuzzleEnvironment()
    prompt = env.prompts(1, seed=3, offset=0)[0]
    actions = shortest_solution(prompt["metadata"]["game_state"]["board"])
    results = play(env, prompt, actions)
    assert len(results) == len(actions)
    assert [r.terminated for r in results] == [False] * (len(actions) - 1) + [True]
    assert [r.reward for r in results] == [0.0] * (len(actions) - 1) + [1.0]
    assert results[-1].metadata is None
    assert all(r.next_stop_strings == ["</action>"] for r in results[:-1])
    assert all(r.observation.startswith("<environment>") and r.observation.endswith("</environment>\n")
               for r in results)


def test_every_generated_puzzle_is_solvable_within_its_move_budget():
    env = SlidingPuzzleEnvironment()
    for prompt in env.prompts(20, seed=11, offset=5):
        meta = prompt["metadata"]
        board = meta["game_state"]["board"]
        assert board != solved_board(len(board))
        assert len(shortest_solution(board)) <= meta["max_moves"]


def test_slide_row_col_moves_the_named_tile():
    board = [[1, 2], [0, 3]]
    assert apply_action(board, "slide 2 2") == [[1, 2], [3, 0]]
    assert apply_action(board, "Slide  1 1") == [[0, 2], [1, 3]]
    assert apply_action(board, "slide 1 2") is None  # diagonal, not a neighbour
    assert apply_action(board, "left") == [[1, 2], [3, 0]]


def test_invalid_action_keeps_the_board_and_uses_a_move():
    env = SlidingPuzzleEnvironment()
    meta = {"game_state": {"size": 2, "board": [[1, 2], [0, 3]]}, "num_moves": 0, "max_moves": 5}
    for content in ("<action>fly away</action>", "no action at all", "<action>right</action>"):
        result = env.step([[{"role": "assistant", "content": content}]], [meta])[0]
        assert (result.reward, result.terminated, result.error) == (0.0, False, "")
        assert result.metadata == {**meta, "num_moves": 1}
        assert result.next_stop_strings == ["</action>"]


def test_running_out_of_moves_terminates_with_metadata_none():
    env = SlidingPuzzleEnvironment()
    meta = {"game_state": {"size": 2, "board": [[1, 2], [0, 3]]}, "num_moves": 2, "max_moves": 3}
    result = env.step([[{"role": "assistant", "content": "<action>up</action>"}]], [meta])[0]
    assert (result.reward, result.terminated, result.metadata) == (0.0, True, None)


def test_float_numbers_from_protobuf_struct_are_accepted():
    env = SlidingPuzzleEnvironment()
    meta = {"game_state": {"size": 2.0, "board": [[1.0, 2.0], [0.0, 3.0]]},
            "num_moves": 0.0, "max_moves": 4.0}
    result = env.step([[{"role": "assistant", "content": "<action>left</action>"}]], [meta])[0]
    assert (result.reward, result.terminated, result.metadata) == (1.0, True, None)


@pytest.mark.parametrize("board", [[[1, 2], [3, 4]], [[1, 2, 0]], [[0, 0], [1, 2]]])
def test_malformed_board_fails_the_episode_without_raising(board):
    env = SlidingPuzzleEnvironment()
    meta = {"game_state": {"size": 2, "board": board}, "num_moves": 0, "max_moves": 4}
    result = env.step([[{"role": "assistant", "content": "<action>up</action>"}]], [meta])[0]
    assert (result.reward, result.terminated) == (0.0, True)
    assert result.error


def test_prompts_are_reproducible_for_the_same_seed_and_offset():
    env = SlidingPuzzleEnvironment()
    assert env.prompts(5, seed=7, offset=10) == env.prompts(5, seed=7, offset=10)
    assert env.prompts(5, seed=7, offset=10)[2:] == env.prompts(3, seed=7, offset=12)
    assert env.prompts(5, seed=7, offset=10) != env.prompts(5, seed=8, offset=10)


def test_settings_bound_the_generated_boards_as_nemo_rl_s_game_config():
    env = SlidingPuzzleEnvironment(size=5, shuffle_moves=10, max_moves=30)
    prompts = env.prompts(200, seed=1, offset=0)
    sizes = {p["metadata"]["game_state"]["size"] for p in prompts}
    assert sizes == {2, 3, 4, 5} and all(p["metadata"]["max_moves"] == 30 for p in prompts)
    for p in prompts[:40]:
        board = p["metadata"]["game_state"]["board"]
        assert board != solved_board(len(board))
        if len(board) <= 3:  # breadth-first search stays cheap up to 3x3
            assert len(shortest_solution(board)) <= 10 + 1  # a board that ended solved takes one more move


def test_a_scramble_that_cycles_back_to_solved_goes_on_instead_of_looping():
    # On 2x2 moves that never undo the last one bring the board back to solved every 12 moves.
    env = SlidingPuzzleEnvironment(size=2, shuffle_moves=24)
    for p in env.prompts(30, seed=0, offset=0):
        board = p["metadata"]["game_state"]["board"]
        assert board != solved_board(2)
        assert len(shortest_solution(board)) <= p["metadata"]["max_moves"]


def test_view_shows_the_board_and_is_not_a_move():
    env = SlidingPuzzleEnvironment()
    meta = {"game_state": {"size": 2, "board": [[1, 2], [0, 3]]}, "num_moves": 2.0, "max_moves": 3}
    result = env.step([[{"role": "assistant", "content": "<action>view</action>"}]], [meta])[0]
    assert (result.reward, result.terminated) == (0.0, False)
    assert result.metadata == {"game_state": {"size": 2, "board": [[1, 2], [0, 3]]}, "num_moves": 2, "max_moves": 3}
    assert "1 2\n_ 3" in result.observation and "Moves left: 1." in result.observation


@pytest.mark.parametrize("settings", [{"size": 1}, {"shuffle_moves": 0}, {"max_moves": -1}])
def test_settings_out_of_range_are_refused(settings):
    with pytest.raises(ValueError, match="sliding_puzzle needs"):
        SlidingPuzzleEnvironment(**settings)
