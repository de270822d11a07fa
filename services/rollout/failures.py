"""What a rollout worker does with a group whose episode raised: the pure decision, apart from the worker's IO.

    environment gone (NOT_FOUND)              ──▶ GONE:      announced stale, dropped (the controller replaces it)
    broker or environment outage (transient)  ──▶ HAND_BACK: nak after hand_back_delay, for as long as it lasts
    any other error (an environment's INTERNAL
    or UNKNOWN included), delivery < bound    ──▶ HAND_BACK
    any other error, delivery >= bound        ──▶ POISON:    dropped, counted, announced (PoisonedGroup)

The delivery count is JetStream's (`msg.metadata.num_delivered`), so it survives a worker's restart and counts
every delivery: also those a worker handed back without running the group (its weights too old for the
step) and those that met an outage. A group that waited so may be poisoned on fewer failed tries than the
bound, never on an outage alone (docs/reliability.md).
"""

from __future__ import annotations

import grpc
import nats.errors

from services.common.server import RETRIED

GONE = "gone"
HAND_BACK = "hand_back"
POISON = "poison"
MAX_ERROR_CHARS = 500


OUTAGE = RETRIED - {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
"""gRPC codes of an outage. INTERNAL and UNKNOWN are not one: the server ran the request and broke on it (an
environment that raised), so the same group breaks the same way on every delivery and counts toward the bound."""


def transient(err: Exception) -> bool:
    """A busy or restarting broker or environment service: expected, and the group is run again."""
    return isinstance(err, nats.errors.Error) or (isinstance(err, grpc.aio.AioRpcError) and err.code() in OUTAGE)


def fate(err: Exception, deliveries: int, max_failures: int) -> str:
    """GONE, HAND_BACK or POISON for a group that raised `err` on its `deliveries`-th delivery."""
    if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.NOT_FOUND:
        return GONE
    if transient(err) or deliveries < max_failures:
        return HAND_BACK
    return POISON


def describe(err: Exception) -> str:
    """The error on one line, short enough for a console line and an event."""
    if isinstance(err, grpc.aio.AioRpcError):
        text = f"{type(err).__name__}: {err.code().name} {err.details()}"
    else:
        text = f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."
