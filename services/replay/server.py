"""The ReplayService gRPC servicer: validate, call the store, encode. No buffer logic here.

Sample also tells the controller about evicted groups (StaleGroups on the run's `stale`
subject, in JetStream, so none is lost while the controller is down) so it leases their
prompts again, and wakes ingest when it freed buffer room. The eviction itself puts the ids
in a Redis outbox in the same atomic script, and they leave it only once published, so a
replay killed between the two announces them after its restart (`announce_stale`). With the run's shape (`RunShape`),
Sample and Commit are also checked against the trainer's reported progress (store `in_order`).
Sample answers with pre-encoded bytes: the stored group bytes are spliced into the
response without being parsed (`encode_sample_response`; `sample_response` is the slow,
obvious reference it is tested against), so `register` installs a pass-through serializer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from services.common.bus import Bus
from services.common.config import ReplayConfig
from services.common.errors import FailedPrecondition, InvalidArgument, require
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc, types_pb2
from services.replay.metrics import BUFFER_GROUPS, CHOSEN_STALENESS, SAMPLE_SECONDS, STALE_DROPPED
from services.replay.pulse import Pulse
from services.replay.store import OutOfOrder, ReplayStore, SampleResult, StepCommitted, StoreStats


log = logging.getLogger("flywheel.replay")
ANNOUNCE_S = 1.0
"""How often the stale outbox is checked besides after each Sample (a publish that failed is retried)."""
REPORT_WAIT_S = 5.0
"""How long Commit waits for the step report that covers it (it may trail the Commit on another connection)."""
SAMPLE_HOLD_S = 0.5
"""How long the service's Sample holds a not-ready answer while it waits for ingest to store groups (it
answers as soon as the batch is ready): the trainer waits on this instead of polling replay and Redis."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RunShape:
    """The batches this run's trainer asks for (its grpo config); Sample requests of another shape are refused."""

    prompts_per_step: int
    max_staleness: int


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """`run`: the run this replay serves. With it, Sample and Commit are checked against the run's
    shape and the trainer's reported progress; without it (tests of the buffer alone), they are not."""

    def __init__(self, store: ReplayStore, bus: Bus | None, cfg: ReplayConfig,
                 space: asyncio.Event | None = None, *, run: RunShape | None = None,
                 stored: Pulse | None = None, reported: Pulse | None = None, hold_s: float = 0.0) -> None:
        """`stored` (fired by ingest) and `hold_s`: a Sample that is not ready samples again after each write
        that stored groups, for up to `hold_s` seconds, before it answers not ready; 0 answers at once.
        `reported` (fired after each step report is recorded): a Commit that its report has not reached yet
        tries again after each one, for up to REPORT_WAIT_S."""
        self.store = store
        self.bus = bus
        self.cfg = cfg
        self.space = space or asyncio.Event()
        self.run = run
        self.stored = stored or Pulse()
        self.reported = reported or Pulse()
        self.hold_s = hold_s
        self._announcing = asyncio.Lock()  # one publisher of the outbox at a time: no id announced twice

    async def Sample(self, request: replay_pb2.SampleRequest, context: grpc.aio.ServicerContext) -> bytes:
        check_sample_request(request, self.run)
        hold = time.monotonic() + self.hold_s
        while True:
            seen = self.stored.count  # before the read: a group stored during it ends the wait below at once
            result = await self._sample(request)
            left = hold - time.monotonic()
            if result.ready or left <= 0:
                return encode_sample_response(result)
            await self.stored.wait(seen, left)

    async def _sample(self, request: replay_pb2.SampleRequest) -> SampleResult:
        with SAMPLE_SECONDS.time():
            try:
                result = await self.store.sample(request.step, request.prompts_per_step, request.max_staleness,
                                                 self.cfg.selection, in_order=self.run is not None)
            except StepCommitted as err:
                raise InvalidArgument(str(err)) from None
            except OutOfOrder as err:
                raise FailedPrecondition(str(err)) from None
        if result.stale_ids:
            STALE_DROPPED.inc(len(result.stale_ids))
            await self.announce_stale()
        if result.stale_ids or (result.ready and not result.replayed):
            self.space.set()
        for version in result.versions:
            CHOSEN_STALENESS.observe(request.step - version)
        return result

    async def announce_stale(self) -> None:
        """Publish the outbox's evicted ids to the controller, then trim them from it. Through JetStream (with
        a dedup id), so a re-lease survives the controller being down."""
        if self.bus is None:
            return
        async with self._announcing:
            ids = await self.store.stale_outbox()
            if not ids:
                return
            log.info("stale groups evicted: %s", " ".join(ids))
            await self.bus.publish(self.bus.subjects.stale, types_pb2.StaleGroups(group_ids=ids),
                                   msg_id=f"stale:{ids[0]}:{len(ids)}")
            await self.store.trim_stale_outbox(len(ids))

    async def announce_stale_until(self, stop: asyncio.Event) -> None:
        """Announce what a crash (or a failed publish) left in the outbox, at start and then every ANNOUNCE_S."""
        while not stop.is_set():
            try:
                await self.announce_stale()
            except Exception as err:  # Redis or NATS restarting: the outbox keeps the ids
                log.warning("stale groups not announced yet: %s", err)
            try:
                await asyncio.wait_for(stop.wait(), ANNOUNCE_S)
            except asyncio.TimeoutError:
                pass

    async def Stats(self, request: replay_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> replay_pb2.StatsResponse:
        stats = await self.store.stats()
        BUFFER_GROUPS.set(stats.size)
        return stats_response(stats, self.cfg.capacity_groups, time.time())

    async def Commit(self, request: replay_pb2.CommitRequest, context: grpc.aio.ServicerContext
                     ) -> replay_pb2.CommitResponse:
        require(request.step >= 0, f"step must be >= 0, got {request.step}")
        if self.run is None:
            return replay_pb2.CommitResponse(deleted_groups=await self.store.commit(request.step))
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            seen = self.reported.count  # before the try: a report recorded during it ends the wait below at once
            try:
                return replay_pb2.CommitResponse(deleted_groups=await self.store.commit(request.step, in_order=True))
            except OutOfOrder as err:
                left = deadline - time.monotonic()
                if err.reason != "not checkpointed" or left <= 0:
                    raise FailedPrecondition(f"Commit refused, nothing deleted: {err}") from None
            await self.reported.wait(seen, left)  # the step report that covers it may still be on its way


def check_sample_request(request: replay_pb2.SampleRequest, run: RunShape | None = None) -> None:
    require(request.step >= 0, f"step must be >= 0, got {request.step}")
    require(request.prompts_per_step > 0, f"prompts_per_step must be > 0, got {request.prompts_per_step}")
    require(request.max_staleness >= 0, f"max_staleness must be >= 0, got {request.max_staleness}")
    if run is not None and (request.prompts_per_step, request.max_staleness) != (run.prompts_per_step,
                                                                                  run.max_staleness):
        raise FailedPrecondition(f"this run samples prompts_per_step={run.prompts_per_step} with "
                                 f"max_staleness={run.max_staleness}; got {request.prompts_per_step} and "
                                 f"{request.max_staleness}")


def register(servicer: ReplayServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_ReplayServiceServicer_to_server, but Sample's reply is already bytes."""
    handlers = {
        "Sample": grpc.unary_unary_rpc_method_handler(
            servicer.Sample, request_deserializer=replay_pb2.SampleRequest.FromString,
            response_serializer=_bytes_or_message),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, request_deserializer=replay_pb2.StatsRequest.FromString,
            response_serializer=replay_pb2.StatsResponse.SerializeToString),
        "Commit": grpc.unary_unary_rpc_method_handler(
            servicer.Commit, request_deserializer=replay_pb2.CommitRequest.FromString,
            response_serializer=replay_pb2.CommitResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flywheel.v1.ReplayService", handlers),))


def _bytes_or_message(reply) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def encode_sample_response(result: SampleResult) -> bytes:
    """SampleResponse wire bytes with the stored groups spliced in as field 3, unparsed.

    Parses to the same message as sample_response(result); protobuf accepts fields in any order.
    """
    head = replay_pb2.SampleResponse(ready=result.ready, missing=result.missing,
                                     stale_dropped=len(result.stale_ids)).SerializeToString()
    parts = [head]
    for payload in result.payloads:
        parts += [_GROUPS_TAG, _varint(len(payload)), payload]
    return b"".join(parts)


_GROUPS_TAG = bytes([(3 << 3) | 2])  # field 3 (groups), wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def sample_response(result: SampleResult) -> replay_pb2.SampleResponse:
    """Store result -> proto, the slow and obvious way (reference for encode_sample_response)."""
    return replay_pb2.SampleResponse(
        ready=result.ready, missing=result.missing, stale_dropped=len(result.stale_ids),
        groups=[types_pb2.TrajectoryGroup.FromString(p) for p in result.payloads])


def stats_response(stats: StoreStats, capacity: int, now_s: float) -> replay_pb2.StatsResponse:
    age = max(0.0, now_s - stats.oldest_finished_at_s) if stats.oldest_finished_at_s is not None else 0.0
    return replay_pb2.StatsResponse(
        size=stats.size, size_by_version=stats.size_by_version, stale_dropped=stats.stale_dropped,
        oldest_age_seconds=age, capacity=capacity, dead_lettered=stats.dead_lettered,
        duplicates=stats.duplicates)
