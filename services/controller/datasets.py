"""Cursors over an environment's prompts: rows in epochs (NeMo RL's order), or a generated stream.

Rows come from data.* (services/common/data/) or from an environment's own JSONL / inline rows.
"""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import types_pb2
from services.common.data.plan import position


class Exhausted(Exception):
    """The cursor's epochs are used up: lease nothing more from it."""


class Cursor:
    """Endless, reproducible walk over rows (in epochs) or over an environment's generated stream."""

    def __init__(self, rows: list[types_pb2.DatasetRow] | None = None, fetch=None, chunk: int = 256,
                 prefetched: list[types_pb2.DatasetRow] = ()) -> None:
        self.rows = rows
        self.fetch = fetch  # async (offset, count) -> rows, for generated prompts
        self.chunk = chunk
        self.offset = 0
        self._buffer: list[types_pb2.DatasetRow] = list(prefetched)

    def seek(self, offset: int) -> None:
        """Continue at `offset` (a restored run); generated rows are fetched again from there."""
        self.offset = offset
        if offset:
            self._buffer = []

    async def next(self) -> tuple[str, types_pb2.DatasetRow]:
        index = self.offset
        self.offset += 1
        if self.rows is not None:
            return str(index), self.rows[index % len(self.rows)]
        if not self._buffer:
            self._buffer = list(await self.fetch(index, self.chunk))
            if not self._buffer:
                raise InvalidArgument("environment generated no prompts")
        return str(index), self._buffer.pop(0)


class EpochCursor:
    """data.train rows in NeMo RL's order: num_prompts_per_step per step, reshuffled each epoch, the last
    partial step of an epoch dropped, max_num_epochs epochs. `offset` (prompts leased) is its whole state."""

    def __init__(self, rows: list[types_pb2.DatasetRow], *, prompts_per_step: int, epochs: int, seed: int,
                 shuffle: bool, offset: int = 0) -> None:
        self.rows, self.prompts_per_step, self.seed, self.shuffle = rows, prompts_per_step, seed, shuffle
        self.limit = epochs * (len(rows) // prompts_per_step) * prompts_per_step
        self.offset = offset

    def seek(self, offset: int) -> None:
        self.offset = offset

    @property
    def epoch(self) -> int:
        per_epoch = (len(self.rows) // self.prompts_per_step) * self.prompts_per_step
        return self.offset // per_epoch if per_epoch else 0

    async def next(self) -> tuple[str, types_pb2.DatasetRow]:
        """(prompt id "epoch/row", row); raises Exhausted after the last epoch."""
        if self.offset >= self.limit:
            raise Exhausted()
        epoch, index = position(self.offset, len(self.rows), self.prompts_per_step, self.seed, self.shuffle)
        self.offset += 1
        return f"e{epoch}/{index}", self.rows[index]
