"""Small TrajectoryGroup factories shared by the replay tests."""

from __future__ import annotations

from services.common.pb.flywheel.v1 import types_pb2


def make_group(group_id: str, version: int = 0, *, completions: int = 2, tokens: int = 4) -> types_pb2.TrajectoryGroup:
    """A well-formed group whose completions all started at `version`."""
    return types_pb2.TrajectoryGroup(
        group_id=group_id, prompt_id=f"p-{group_id}", env_name="toy", target_step=version,
        prompt_token_ids=[1, 2, 3], version_start=version, finished_at_unix_ns=1_700_000_000_000_000_000,
        completions=[types_pb2.Completion(token_ids=list(range(tokens)), generated_mask=[True] * tokens,
                                          generation_logprobs=[-0.5] * tokens, version_start=version,
                                          version_end=version, reward=float(i))
                     for i in range(completions)])
