"""Episodes: the session key that names one, the token that authorizes calls in it, its limits and recording.

A rollout worker opens an episode before an agent starts (`Sessions.open`), hands the agent the base URL
(which holds the session key) and the token (its API key), and closes it when the agent is done
(`Sessions.close`), which returns the trajectory. A call names an episode by its URL path
`/sessions/<key>/v1/...` (or the header `X-Flywheel-Session` on `/v1/...`) and carries `Authorization: Bearer
<token>`. Outside a live episode it is refused: 401 without the episode's token, 404 for a key never opened,
410 for an episode already closed.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from prometheus_client import Gauge

from services.common.config import GenerationConfig
from services.rollout.endpoint.errors import ApiError
from services.rollout.endpoint.recording import Recording
from services.rollout.endpoint.trajectory import Trajectory

OPEN_EPISODES = Gauge("flywheel_endpoint_open_episodes", "Episodes open on this worker's endpoint")
FINISHED_KEPT = 4096
"""Closed session keys remembered, so a late call hears 'finished' rather than 'unknown'."""


@dataclass(kw_only=True, slots=True)
class Limits:
    max_sequence_tokens: int
    """Prompt + completion of any call (the trainer's policy.max_total_sequence_length)."""
    max_calls: int = 1024
    """Calls one episode may make; a runaway agent is refused after that many."""


@dataclass(kw_only=True, slots=True)
class Episode:
    key: str
    token: str
    limits: Limits
    metadata: dict[str, Any] = field(default_factory=dict)
    """The prompt group's (group id, prompt id, environment, ...) for the worker: kept, not read."""
    sampling: GenerationConfig | None = None
    """GenerationConfig whose values fill the sampling fields a call leaves out (its environment's `sampling` over
    policy.generation); None: policy.generation's."""
    context: Any = None
    """The trace context current at open (the group's): each call's span is its child."""
    recording: Recording = field(default_factory=Recording)
    calls: int = 0
    closed: bool = False


class Sessions:
    def __init__(self) -> None:
        self.episodes: dict[str, Episode] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()

    def open(self, limits: Limits, metadata: dict[str, Any] | None = None,
             sampling: GenerationConfig | None = None) -> Episode:
        episode = Episode(key=secrets.token_hex(16), token=secrets.token_urlsafe(32), limits=limits,
                          metadata=dict(metadata or {}), sampling=sampling, context=otel_context.get_current())
        self.episodes[episode.key] = episode
        OPEN_EPISODES.set(len(self.episodes))
        return episode

    def close(self, key: str) -> Trajectory:
        episode = self.episodes.pop(key)
        episode.closed = True
        self.finished[key] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        OPEN_EPISODES.set(len(self.episodes))
        return episode.recording.builder.trajectory

    def authorize(self, key: str | None, token: str | None) -> Episode:
        if not key:
            raise ApiError(404, "no session: call /sessions/<session key>/v1/... (or send the "
                                "X-Flywheel-Session header) with the key of an open episode",
                           code="session_required")
        episode = self.episodes.get(key)
        if episode is None:
            if key in self.finished:
                raise ApiError(410, "this episode is finished: its calls are no longer accepted",
                               code="episode_finished")
            raise ApiError(404, "unknown session: no open episode has this key", code="session_not_found")
        if token is None or not hmac.compare_digest(token.encode(), episode.token.encode()):
            raise ApiError(401, f"{'missing' if token is None else 'invalid'} episode token: send "
                                "'Authorization: Bearer <token>' (the OpenAI SDK's api_key)",
                           code="invalid_api_key", type="authentication_error")
        return episode
