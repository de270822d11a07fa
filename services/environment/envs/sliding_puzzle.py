"""The "sliding_puzzle" environment: a multi-turn sliding-tile game, like NeMo RL's sliding puzzle example.

Each turn the model answers with one move inside <action>...</action>:
- "up", "down", "left" or "right" slides the tile next to the gap in that direction into the gap
  ("up" moves the tile below the gap up);
- "slide R C" slides the tile at row R, column C (1-based) into the gap, when they are neighbours;
- "view" shows the board again and is not a move (as in NeMo RL; grpo.max_rollout_turns still bounds the turns).
The board is solved when it reads 1, 2, ..., n*n-1 row by row with the gap (0) last.

Metadata: {"game_state": {"size": n, "board": [[int]]}, "num_moves": k, "max_moves": m}. Numbers may
arrive as floats (protobuf Struct), so they are read with int(). An invalid or impossible action counts
as a move and leaves the board unchanged. Reward 1.0 on the move that solves the board; the episode ends
when solved or after max_moves moves, and then the returned metadata is None.

Settings (the config's env.sliding_puzzle; NeMo RL's env.sliding_puzzle_game.cfg moves there): generated
boards are 2x2 up to `size` x `size`, each 1 to `shuffle_moves` random moves from solved, as NeMo RL's
sliding-puzzle example draws them. Unlike NeMo RL's shuffle, no move undoes the one before, and a board that
ends solved takes more moves until it is not, so every prompt needs at least one move.
"""

from __future__ import annotations

import random
import re

from services.environment.base import Environment, StepResult, last_assistant, score_each

Board = list[list[int]]
"""size x size tiles, row-major; 0 is the gap."""

ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)
SLIDE = re.compile(r"slide\s+(\d+)\s+(\d+)")
# Direction a tile moves -> where that tile sits relative to the gap (row, col offset).
DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
STOP = ["</action>"]


def solved_board(size: int) -> Board:
    return [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]


def find_gap(board: Board) -> tuple[int, int]:
    for r, row in enumerate(board):
        if 0 in row:
            return r, row.index(0)
    raise ValueError("board has no gap (0)")


def read_board(rows) -> Board:
    """A validated board from metadata (tiles may be floats after a protobuf Struct)."""
    board = [[int(t) for t in row] for row in rows]
    size = len(board)
    if size < 2 or any(len(row) != size for row in board):
        raise ValueError(f"board must be square and at least 2x2, got {board}")
    if sorted(t for row in board for t in row) != list(range(size * size)):
        raise ValueError(f"board must hold each of 0..{size * size - 1} once, got {board}")
    return board


def apply_action(board: Board, action: str) -> Board | None:
    """The board after `action`, or None when the action is unknown or impossible here."""
    action = " ".join(action.strip().lower().split())
    gap_r, gap_c = find_gap(board)
    if action in DIRECTIONS:
        dr, dc = DIRECTIONS[action]
        tile_r, tile_c = gap_r + dr, gap_c + dc
    elif match := SLIDE.fullmatch(action):
        tile_r, tile_c = int(match[1]) - 1, int(match[2]) - 1
        if abs(tile_r - gap_r) + abs(tile_c - gap_c) != 1:
            return None
    else:
        return None
    size = len(board)
    if not (0 <= tile_r < size and 0 <= tile_c < size):
        return None
    moved = [row[:] for row in board]
    moved[gap_r][gap_c], moved[tile_r][tile_c] = moved[tile_r][tile_c], 0
    return moved


def scramble(size: int, moves: int, rng: random.Random) -> tuple[Board, int]:
    """(a board at least `moves` random legal moves from solved, never undoing the previous one, the moves made).

    Moves go on past `moves` while the board is solved: on 2x2 such moves cycle back to solved every 12."""
    inverse = {"up": "down", "down": "up", "left": "right", "right": "left"}
    solved = solved_board(size)
    board, previous, made = solved, None, 0
    while made < moves or board == solved:
        options = [a for a in DIRECTIONS if a != inverse.get(previous) and apply_action(board, a)]
        previous = rng.choice(options)
        board, made = apply_action(board, previous), made + 1
    return board, made


def render(board: Board) -> str:
    width = len(str(len(board) ** 2 - 1))
    return "\n".join(" ".join(str(t).rjust(width) if t else "_".rjust(width) for t in row) for row in board)


class SlidingPuzzleEnvironment(Environment):
    kind = "sliding_puzzle"

    def __init__(self, size: int = 3, shuffle_moves: int = 4, max_moves: int = 0) -> None:
        if size < 2 or shuffle_moves < 1 or max_moves < 0:
            raise ValueError(f"sliding_puzzle needs size >= 2, shuffle_moves >= 1 and max_moves >= 0; got {size}, "
                             f"{shuffle_moves}, {max_moves}")
        self.size = size
        """The largest board prompts() draws; sizes go from 2 up to it."""
        self.shuffle_moves = shuffle_moves
        """The most random moves a board is from solved; each board draws 1 up to it."""
        self.max_moves = max_moves
        """Moves allowed per episode; 0 = twice the board's own shuffle moves, plus 4."""

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        results = score_each(self._one, conversations, metadata)
        if not return_extracted_answer:
            for result in results:
                result.answer = None
        return results

    def _one(self, conversation: list[dict], meta: dict) -> StepResult:
        board = read_board(meta["game_state"]["board"])
        made, max_moves = int(meta["num_moves"]), int(meta["max_moves"])
        actions = ACTION.findall(last_assistant(conversation))
        action = actions[-1].strip() if actions else ""
        if action.lower() == "view":
            return StepResult(observation=_observe(board, f"No move made. Moves left: {max_moves - made}."),
                              terminated=False, next_stop_strings=list(STOP), metadata=_state(board, made, max_moves),
                              answer=action)
        num_moves = made + 1
        moved = apply_action(board, action) if action else None
        if moved is None:
            note = f"Invalid action {action!r}." if action else "No <action>...</action> found."
        else:
            board, note = moved, f"Moved: {action}."
        if board == solved_board(len(board)):
            return StepResult(observation=_observe(board, note + " Solved!"), reward=1.0, answer=action)
        if num_moves >= max_moves:
            return StepResult(observation=_observe(board, note + " Out of moves."), answer=action)
        return StepResult(observation=_observe(board, note + f" Moves left: {max_moves - num_moves}."),
                          terminated=False, next_stop_strings=list(STOP), metadata=_state(board, num_moves, max_moves),
                          answer=action)

    def prompts(self, count: int, seed: int, offset: int) -> list[dict]:
        return [self._prompt(random.Random(f"sliding_puzzle:{seed}:{offset + i}")) for i in range(count)]

    def _prompt(self, rng: random.Random) -> dict:
        size = rng.randint(2, self.size)
        board, moves = scramble(size, rng.randint(1, self.shuffle_moves), rng)
        text = (
            f"Solve this {size}x{size} sliding puzzle. The goal is the tiles in order 1, 2, ... row by row "
            "with the gap (_) last.\n"
            f"{render(board)}\n"
            "Each turn, give one move inside <action></action>: up, down, left or right slides the tile "
            "next to the gap in that direction into it, and 'slide R C' slides the tile at row R, column C "
            "(1-based). For example <action>left</action>. <action>view</action> shows the board again."
        )
        return {"messages": [{"role": "user", "content": text}],
                "metadata": _state(board, 0, self.max_moves or 2 * moves + 4)}


def _state(board: Board, num_moves: int, max_moves: int) -> dict:
    return {"game_state": {"size": len(board), "board": board}, "num_moves": num_moves, "max_moves": max_moves}


def _observe(board: Board, note: str) -> str:
    return f"<environment>\n{render(board)}\n{note}\n</environment>\n"
