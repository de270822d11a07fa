"""The "sliding_puzzle" environment: a multi-turn sliding-tile game, like NeMo RL's sliding puzzle example.

Each turn the model answers with one move inside <action>...</action>:
- "up", "down", "left" or "right" slides the tile next to the gap in that direction into the gap
  ("up" moves the tile below the gap up);
- "slide R C" slides the tile at row R, column C (1-based) into the gap, when they are neighbours.
The board is solved when it reads 1, 2, ..., n*n-1 row by row with the gap (0) last.

Metadata: {"game_state": {"size": n, "board": [[int]]}, "num_moves": k, "max_moves": m}. Numbers may
arrive as floats (protobuf Struct), so they are read with int(). An invalid or impossible action counts
as a move and leaves the board unchanged. Reward 1.0 on the move that solves the board; the episode ends
when solved or after max_moves moves, and then the returned metadata is None.
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


def scramble(size: int, moves: int, rng: random.Random) -> Board:
    """A board `moves` random legal moves from solved (never undoing the previous one), not solved."""
    inverse = {"up": "down", "down": "up", "left": "right", "right": "left"}
    while True:
        board, previous = solved_board(size), None
        for _ in range(moves):
            options = [a for a in DIRECTIONS if a != inverse.get(previous) and apply_action(board, a)]
            previous = rng.choice(options)
            board = apply_action(board, previous)
        if board != solved_board(size):
            return board


def render(board: Board) -> str:
    width = len(str(len(board) ** 2 - 1))
    return "\n".join(" ".join(str(t).rjust(width) if t else "_".rjust(width) for t in row) for row in board)


class SlidingPuzzleEnvironment(Environment):
    kind = "sliding_puzzle"

    def __init__(self, sizes: tuple[int, ...] = (2, 3), scramble_moves: tuple[int, int] = (1, 4),
                 extra_moves: int = 4) -> None:
        self.sizes = sizes
        """Board sizes prompts() draws from."""
        self.scramble_moves = scramble_moves
        """Inclusive range of random moves away from solved."""
        self.extra_moves = extra_moves
        """max_moves = 2 * scramble moves + extra_moves."""

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        results = score_each(self._one, conversations, metadata)
        if not return_extracted_answer:
            for result in results:
                result.answer = None
        return results

    def _one(self, conversation: list[dict], meta: dict) -> StepResult:
        board = read_board(meta["game_state"]["board"])
        num_moves, max_moves = int(meta["num_moves"]) + 1, int(meta["max_moves"])
        actions = ACTION.findall(last_assistant(conversation))
        action = actions[-1].strip() if actions else ""
        moved = apply_action(board, action) if action else None
        if moved is None:
            note = f"Invalid action {action!r}." if action else "No <action>...</action> found."
        else:
            board, note = moved, f"Moved: {action}."
        if board == solved_board(len(board)):
            return StepResult(observation=_observe(board, note + " Solved!"), reward=1.0, answer=action)
        if num_moves >= max_moves:
            return StepResult(observation=_observe(board, note + " Out of moves."), answer=action)
        state = {"game_state": {"size": len(board), "board": board}, "num_moves": num_moves,
                 "max_moves": max_moves}
        return StepResult(observation=_observe(board, note + f" Moves left: {max_moves - num_moves}."),
                          terminated=False, next_stop_strings=list(STOP), metadata=state, answer=action)

    def prompts(self, count: int, seed: int, offset: int) -> list[dict]:
        return [self._prompt(random.Random(f"sliding_puzzle:{seed}:{offset + i}")) for i in range(count)]

    def _prompt(self, rng: random.Random) -> dict:
        size = rng.choice(self.sizes)
        moves = rng.randint(*self.scramble_moves)
        board = scramble(size, moves, rng)
        text = (
            f"Solve this {size}x{size} sliding puzzle. The goal is the tiles in order 1, 2, ... row by row "
            "with the gap (_) last.\n"
            f"{render(board)}\n"
            "Each turn, give one move inside <action></action>: up, down, left or right slides the tile "
            "next to the gap in that direction into it, and 'slide R C' slides the tile at row R, column C "
            "(1-based). For example <action>left</action>."
        )
        metadata = {"game_state": {"size": size, "board": board}, "num_moves": 0,
                    "max_moves": 2 * moves + self.extra_moves}
        return {"messages": [{"role": "user", "content": text}], "metadata": metadata}


def _observe(board: Board, note: str) -> str:
    return f"<environment>\n{render(board)}\n{note}\n</environment>\n"
