"""The ReplayService gRPC servicer: validate, call the store, encode. No buffer logic here.

Sample also tells the controller about evicted groups (StaleGroups on the run's `stale`
subject) so it leases their prompts again, and wakes ingest when it freed buffer room.
Sample answers with pre-encoded bytes: the stored group bytes are spliced into the
response without being parsed (`encode_sample_response`; `sample_response` is the slow,
obvious reference it is tested against), so `register` installs a pass-through serializer.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.bus import Bus
from services.common.config import ReplayConfig
from services.common.errors import InvalidArgument, require
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc, types_pb2
from services.replay.metrics import BUFFER_GROUPS, CHOSEN_STALENESS, SAMPLE_SECONDS, STALE_DROPPED
from services.replay.store import ReplayStore, SampleResult, StepCommitted, StoreStats


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    def __init__(self, store: ReplayStore, bus: Bus | None, cfg: ReplayConfig,
                 space: asyncio.Event | None = None) -> None:
        self.store = store
        self.bus = bus
        self.cfg = cfg
        self.space = space or asyncio.Event()

    async def Sample(self, request: replay_pb2.SampleRequest, context: grpc.aio.ServicerContext) -> bytes:
        check_sample_request(request)
        with SAMPLE_SECONDS.time():
            try:
                result = await self.store.sample(request.step, request.prompts_per_step, request.max_staleness,
                                                 self.cfg.selection)
            except StepCommitted as err:
                raise InvalidArgument(str(err)) from None
        if result.stale_ids:
            STALE_DROPPED.inc(len(result.stale_ids))
            if self.bus is not None:
                await self.bus.emit(self.bus.subjects.stale, types_pb2.StaleGroups(group_ids=result.stale_ids))
        if result.stale_ids or (result.ready and not result.replayed):
            self.space.set()
        for version in result.versions:
            CHOSEN_STALENESS.observe(request.step - version)
        return encode_sample_response(result)

    async def Stats(self, request: replay_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> replay_pb2.StatsResponse:
        stats = await self.store.stats()
        BUFFER_GROUPS.set(stats.size)
        return stats_response(stats, self.cfg.capacity_groups, time.time())

    async def Commit(self, request: replay_pb2.CommitRequest, context: grpc.aio.ServicerContext
                     ) -> replay_pb2.CommitResponse:
        require(request.step >= 0, f"step must be >= 0, got {request.step}")
        return replay_pb2.CommitResponse(deleted_groups=await self.store.commit(request.step))


def check_sample_request(request: replay_pb2.SampleRequest) -> None:
    require(request.step >= 0, f"step must be >= 0, got {request.step}")
    require(request.prompts_per_step > 0, f"prompts_per_step must be > 0, got {request.prompts_per_step}")
    require(request.max_staleness >= 0, f"max_staleness must be >= 0, got {request.max_staleness}")


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
