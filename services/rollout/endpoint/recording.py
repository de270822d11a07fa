"""What one episode's calls left: the trajectory builder's samples, and the turns a later call may continue.

Each recorded chat choice keeps the conversation it answered and the assistant message it returned (as
canonical keys) beside its token ids, so a later call that sends that conversation back can be given exactly
those ids (render.py). Every call, chat or not, goes to the TrajectoryBuilder; a call that extends no recorded
sample is counted in `flywheel_endpoint_new_samples_total`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from services.rollout.endpoint.trajectory import Call, TrajectoryBuilder

NEW_SAMPLES = Counter("flywheel_endpoint_new_samples_total",
                      "Endpoint calls whose prompt did not extend the episode's recorded tokens "
                      "(each starts a sample)")


@dataclass(slots=True)
class Turn:
    """One choice of a chat call: the conversation before it, the reply as returned, the ids through it."""

    history: str
    reply: str
    token_ids: list[int]


class Recording:
    def __init__(self) -> None:
        self.builder = TrajectoryBuilder()
        self.turns: list[Turn] = []

    def record(self, call: Call, turns: list[Turn] = (), conversation: list[dict] | None = None) -> bool:
        """Add a finished call; False (and counted) when it started a sample although samples existed.
        `conversation`: a chat call's messages and reply, which then stand for the episode (Trajectory)."""
        extends = self.builder.add(call)
        if not extends:
            NEW_SAMPLES.inc()
        self.turns += turns
        if conversation is not None:
            self.builder.trajectory.conversation = conversation
        return extends

    def continued(self, history: str, reply: str) -> list[int] | None:
        """The ids through the latest recorded turn answering `history` with `reply`; None if none did."""
        for turn in reversed(self.turns):
            if turn.history == history and turn.reply == reply:
                return turn.token_ids
        return None
