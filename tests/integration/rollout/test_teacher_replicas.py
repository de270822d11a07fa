"""Rollout's TeacherClient (services/rollout/teacher_client.py) over real gRPC with several replicas: a dead one is
passed over, the live one scores, and calls spread over live replicas by how busy they are. The servers are the
real TeacherServicer (Batcher, Teacher, error mapping) in this process, on free ports."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import SecurityConfig, load_config
from services.common.infra import free_port
from services.common.pb.flywheel.v1 import rollout_pb2_grpc, types_pb2
from services.common.server import ErrorInterceptor
from services.rollout.teacher import Batcher, Teacher, TeacherServicer, load_teacher
from services.rollout.teacher_client import RETRIES, TeacherClient

K = 3


class CountingServicer(TeacherServicer):
    """The real servicer, counting the Score calls it answers."""

    def __init__(self, batcher: Batcher) -> None:
        super().__init__(batcher)
        self.calls = 0

    async def Score(self, request, context):
        self.calls += 1
        return await super().Score(request, context)


@pytest.fixture
async def teachers():
    cfg = load_config(None, ["++distillation={}", "teacher.model_name=tiny", f"distillation.topk_logits_k={K}"])
    teacher = Teacher(load_teacher(cfg), k=K, max_len=64, max_batch_tokens=4096)
    servers, servicers, addresses = [], [], []
    for _ in range(2):
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        servicer = CountingServicer(Batcher(teacher, wait_s=0.0, max_tokens=4096))
        rollout_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
        servicers.append(servicer)
    yield addresses, servicers
    for server in servers:
        await server.stop(0)


def _group(i: int) -> types_pb2.TrajectoryGroup:
    return types_pb2.TrajectoryGroup(group_id=f"g{i}", prompt_token_ids=[5, 6, 7], completions=[
        types_pb2.Completion(token_ids=[8, 9 + i]), types_pb2.Completion(token_ids=[10, 11, 12])])


async def test_a_dead_replica_is_passed_over_and_live_ones_share_the_groups(teachers):
    addresses, servicers = teachers
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    client = TeacherClient([dead, *addresses], SecurityConfig(), timeout_s=10)
    try:
        groups = [_group(i) for i in range(8)]
        await asyncio.gather(*(client.score(g) for g in groups))
        retries = RETRIES._value.get()
        for i in range(4):  # one at a time: the dead replica, failing since the gather, is not asked again
            await client.score(_group(8 + i))
        assert RETRIES._value.get() == retries
    finally:
        await client.close()
    for g in groups:
        assert [(c.teacher.k, len(c.teacher.logits)) for c in g.completions] == [(K, 2 * K), (K, 3 * K)]
    assert client.replicas[0].failing and not client.replicas[1].failing
    assert sum(s.calls for s in servicers) == 12
    assert min(s.calls for s in servicers) >= 2  # both live replicas took groups


async def test_a_refusal_is_raised_not_retried(teachers):
    addresses, servicers = teachers
    client = TeacherClient(addresses, SecurityConfig(), timeout_s=10)
    bad = types_pb2.TrajectoryGroup(prompt_token_ids=[], completions=[types_pb2.Completion(token_ids=[1])])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(client.score(bad), 30)  # retried, it would never end
    finally:
        await client.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(s.calls for s in servicers) == 1
