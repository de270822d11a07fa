"""What a finished run left in replay, read back the way the trainer asked for it (a run's ledger)."""

from __future__ import annotations

from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc
from services.common.server import channel
from services.local import LocalStack


async def recorded_batches(stack: LocalStack, steps: int) -> list[replay_pb2.SampleResponse]:
    """The batch replay recorded for each of steps 0..steps-1: Sample of a step it has chosen for returns
    that choice again. Checkpoints must be off, since a committed one frees the batches it covers."""
    g = stack.cfg.grpo
    async with channel(stack.cfg.addresses.replay, security=stack.cfg.security) as ch:
        stub = replay_pb2_grpc.ReplayServiceStub(ch)
        return [await stub.Sample(replay_pb2.SampleRequest(step=s, prompts_per_step=g.num_prompts_per_step,
                                                           max_staleness=g.max_staleness), timeout=60)
                for s in range(steps)]
