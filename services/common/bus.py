"""The NATS JetStream bus: subject names, streams (created idempotently), typed publish.

Streams per run (names derive from the run id, so runs share a server safely):
- WORK: the rollout work queue (work-queue retention: a message is gone once acked;
  unacked messages are redelivered after `ack_wait`, which is how a killed rollout
  worker's groups come back).
- TRAJ: finished trajectory groups (work-queue retention; replay acks after its Redis write; a restarted replay
  takes back at once what a killed one fetched and did not ack, `take_back`).
- STATE: last-value subjects (weight announcements), so a late joiner reads the latest.
- EVENTS: events that must not be lost while their consumer is down (StaleGroups, replay ->
  controller, for stale and for dynamic-sampling-filtered groups; PoisonedGroup, rollout -> controller):
  work-queue retention, one durable consumer per subject that acks after handling (`consume`). The
  launcher also watches the poisoned subject with a plain subscription, for its console.
Heartbeats, confirmations and step reports are plain core-NATS events.

The run's KV bucket (`open_state_bucket`) holds the controller's state (controller/state.py) and, under
VALIDATED, each validated policy version's metrics, which the trainer ranks checkpoints by.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Container
from dataclasses import dataclass

import nats
from google.protobuf.message import DecodeError, Message
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError, StaleConnectionError, UnexpectedEOF
from nats.js.api import ConsumerConfig, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, NotFoundError

from services.common.config import SecurityConfig
from services.common.logs import RateLimitedLog
from services.common.telemetry import inject_headers

# nats-py waits up to 30 s by default; a service must stop within 5 s of SIGTERM, and on
# loopback a second is ample to flush what is pending (unacked work is redelivered anyway).
DRAIN_TIMEOUT_S = 1
EVENT_ACK_WAIT_S = 10.0
PUBLISH_ATTEMPTS = 5
"""Sends of a deduplicated publish whose ack times out (JetStream's 5 s each), before the error is raised."""
PUBLISH_BACKOFF_S = 0.5
WORK_DEDUP_WINDOW_S = 3600.0
"""How long the work stream remembers a lease's message id. A restarted controller publishes again the leases
it had not yet saved (controller/main.py), and JetStream drops them only within this window. NATS's default of
2 minutes is shorter than a node's reboot; an hour of ids costs the server a few MB at thousands of leases a minute."""
JS_API = "$JS.API"
"""JetStream's API prefix (the bus uses no JetStream domain)."""
TAKE_BACK_S = 2.0
_warn = RateLimitedLog(logging.getLogger("flywheel.bus"))


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject and stream names of one run."""

    run: str

    @property
    def _token(self) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.run)

    @property
    def work(self) -> str:
        return f"flywheel.{self._token}.work"

    @property
    def trajectories(self) -> str:
        return f"flywheel.{self._token}.trajectories"

    @property
    def weights_announce(self) -> str:
        return f"flywheel.{self._token}.weights.announce"

    @property
    def weights_loaded(self) -> str:
        return f"flywheel.{self._token}.weights.loaded"

    @property
    def heartbeat(self) -> str:
        return f"flywheel.{self._token}.rollout.heartbeat"

    @property
    def train_step(self) -> str:
        return f"flywheel.{self._token}.train.step"

    @property
    def stale(self) -> str:
        return f"flywheel.{self._token}.replay.stale"

    @property
    def filtered(self) -> str:
        """Replay -> controller: groups dropped by dynamic sampling (zero reward variance); lease new prompts."""
        return f"flywheel.{self._token}.replay.filtered"

    @property
    def poisoned(self) -> str:
        """Rollout -> controller and the launcher: a group that failed its deliveries the same way (PoisonedGroup)."""
        return f"flywheel.{self._token}.rollout.poisoned"

    @property
    def dead_letter(self) -> str:
        return f"flywheel.{self._token}.deadletter"

    def stream(self, kind: str) -> str:
        return f"FLYWHEEL_{self._token}_{kind}".upper().replace("-", "_")


def nats_credentials(security: SecurityConfig) -> dict[str, str]:
    """nats.connect keyword arguments: user and password, or a token; none when unset."""
    out = {}
    if security.nats_user:
        out |= {"user": security.nats_user, "password": security.nats_password.get_secret_value()}
    if security.nats_token.get_secret_value():
        out["token"] = security.nats_token.get_secret_value()
    return out


_LINK_ERRORS = (OSError, UnexpectedEOF, StaleConnectionError, SlowConsumerError)
"""The connection's own failures, which nats-py handles by reconnecting (and resubscribing; JetStream redelivers
what was unacked): a server that closed a slow consumer's connection (a flood on a subject it reads), a restart."""


async def _on_error(err: Exception) -> None:
    """nats-py's handler of asynchronous errors, those of subscription callbacks included. A message that does
    not decode is a stray or corrupt publisher's: a rate-limited warning, not a traceback per message. A lost
    connection is a warning too: nats-py reconnects. Anything else is logged as nats-py's default handler does."""
    if isinstance(err, DecodeError):
        _warn.warning("undecodable", "ignored an undecodable message: %s", err)
    elif isinstance(err, _LINK_ERRORS):
        _warn.warning("link", "nats connection: %r; reconnecting", err)
    else:
        logging.getLogger("nats.aio.client").error("nats: encountered error", exc_info=err)


class Bus:
    """One NATS connection plus JetStream context for a service."""

    def __init__(self, nc: Client, run: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = Subjects(run)

    @classmethod
    async def connect(cls, url: str, run: str, *, name: str = "flywheel",
                      security: SecurityConfig | None = None) -> Bus:
        """Connect with the NATS credentials of `security` (default: those in the environment, SECRET_ENV)."""
        nc = await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                drain_timeout=DRAIN_TIMEOUT_S, error_cb=_on_error,
                                **nats_credentials(security or SecurityConfig()))
        bus = cls(nc, run)
        await bus.ensure_streams()
        return bus

    async def ensure_streams(self) -> None:
        s = self.subjects
        await self._ensure(StreamConfig(name=s.stream("work"), subjects=[s.work], duplicate_window=WORK_DEDUP_WINDOW_S,
                                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        await self._ensure(StreamConfig(name=s.stream("traj"), subjects=[s.trajectories],
                                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        await self._ensure(StreamConfig(name=s.stream("state"), subjects=[s.weights_announce, s.dead_letter],
                                        max_msgs_per_subject=1, storage=StorageType.FILE))
        await self._ensure(StreamConfig(name=s.stream("events"), subjects=[s.stale, s.filtered, s.poisoned],
                                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))

    async def _ensure(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError as err:  # exists with another config: keep it, update subjects
            if err.err_code != 10058:
                raise
            await self.js.update_stream(config)

    async def publish(self, subject: str, msg: Message, *, msg_id: str | None = None) -> None:
        """JetStream publish; returns once the server has stored it. With a msg_id, a publish whose ack does not
        come in time (a server too busy to answer: it may have stored the message or not) is sent again, up to
        PUBLISH_ATTEMPTS times: the stream's duplicate window drops the copy if the first was stored. Without one
        a retry could store it twice, so the timeout is the caller's."""
        headers = inject_headers()
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        data = msg.SerializeToString()
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self.js.publish(subject, data, headers=headers or None)
                return
            except nats.errors.TimeoutError:
                if not msg_id or attempt == PUBLISH_ATTEMPTS:
                    raise
                _warn.warning("publish_timeout", "no ack for %s on %s (attempt %d of %d): sending it again",
                              msg_id, subject, attempt, PUBLISH_ATTEMPTS)
                await asyncio.sleep(min(PUBLISH_BACKOFF_S * 2 ** (attempt - 1), 5.0))

    async def consume(self, subject: str, durable: str, handler: Callable[[Msg], Awaitable[None]]):
        """Durable consumer of an EVENTS subject: `handler(msg)`, then ack. A message whose handler raises, or
        that arrives while nobody consumes, waits in the stream and is delivered again (after EVENT_ACK_WAIT_S);
        one that does not decode (the handler raises DecodeError) is dropped, since no redelivery can help. One
        whose consumer was killed before the ack comes to the next consume at once (take_back)."""
        async def handle(msg: Msg) -> None:
            try:
                await handler(msg)
            except DecodeError as err:
                _warn.warning(durable, "dropped an undecodable message on %s: %s", subject, err)
                await msg.term()
                return
            await msg.ack()

        stream = self.subjects.stream("events")
        await self.take_back(stream, durable)
        return await self.js.subscribe(subject, durable=durable, stream=stream, cb=handle,
                                       manual_ack=True, config=ConsumerConfig(ack_wait=EVENT_ACK_WAIT_S))

    async def take_back(self, stream: str, durable: str) -> None:
        """Before a durable consumer of one process (the controller's events, replay's trajectories) is bound: what
        its killed predecessor was handed and did not ack is delivered again now, not after its ack_wait.
        JetStream's consumer reset starts the consumer's delivered and ack state over at the stream's first
        message; on a work-queue stream the acked ones are gone, so what comes again is exactly what was unacked.
        A server that does not know the request (nats-server before the reset API) leaves them to ack_wait."""
        try:
            info = await self.js.consumer_info(stream, durable)
        except NotFoundError:  # a new run: nothing was handed to anyone
            return
        if not info.num_ack_pending:
            return
        try:
            reply = await self.nc.request(f"{JS_API}.CONSUMER.RESET.{stream}.{durable}", b"", timeout=TAKE_BACK_S)
            error = json.loads(reply.data).get("error")
            refused = error and error.get("description", error)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as err:
            refused = repr(err)
        if refused:
            _warn.warning("take_back", "consumer %s was not reset (%s); its unacked messages wait for ack_wait",
                          durable, refused)
        else:
            _warn.warning(durable, "messages a killed %s had not acked, delivered again: %d", durable,
                          info.num_ack_pending)

    async def emit(self, subject: str, msg: Message) -> None:
        """Fire-and-forget core NATS event."""
        await self.nc.publish(subject, msg.SerializeToString(), headers=inject_headers() or None)

    async def close(self) -> None:
        await self.nc.drain()


VALIDATED = "validated."
"""State-bucket key prefix: `validated.<version>` holds the validation metrics of that policy version (JSON)."""


def state_bucket(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"flywheel_{run}_state")


async def open_state_bucket(js: JetStreamContext, run: str):
    """The run's KV bucket (file storage, history 1: only the latest value of a key matters), made if missing."""
    name = state_bucket(run)
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=StorageType.FILE))


async def read_prefixed(js: JetStreamContext, kv, prefix: str, skip: Container[str] = ()) -> dict[str, bytes]:
    """Every key of the bucket that starts with `prefix` (which ends with "."), with its value; the keys in `skip`
    are not read. The keys come from one stream-info request that lists the subjects holding messages, not from
    nats-py's `kv.keys()`: that one watches the bucket and ends where a pending count says it has seen every key,
    and right after a broker restart it once ended short (a trainer's early-stop check missed a validation)."""
    assert prefix.endswith("."), prefix
    status = await kv.status()
    subjects = f"$KV.{status.bucket}."
    info = await js.stream_info(status.stream_info.config.name, subjects_filter=f"{subjects}{prefix}>")
    keys = [s.removeprefix(subjects) for s in (info.state.subjects or {})]
    out = {}
    for key in keys:
        if key in skip:
            continue
        try:
            out[key] = (await kv.get(key)).value
        except KeyNotFoundError:  # deleted or purged (its marker holds the subject), or purged since the listing
            continue
    return out


async def read_validated(js: JetStreamContext, kv, known: Collection[int] = ()) -> dict[int, dict[str, float]]:
    """Policy version -> its validation metrics (e.g. {"validation/accuracy": 0.5}), as the controller put them; the
    versions in `known` are left out (a version's validation is written once, so a reader can keep what it read)."""
    skip = {f"{VALIDATED}{version}" for version in known}
    return {int(key.removeprefix(VALIDATED)): json.loads(value)
            for key, value in (await read_prefixed(js, kv, VALIDATED, skip)).items()}
