"""A multi-turn episode through the rollout's EpisodeRunner: a real tiny HF engine and a real environment
service over gRPC playing the sliding puzzle.

Each turn's environment state (the board and the move count, in the Step result's metadata) must come back
with the next Step; the puzzle's observations count the moves left, so the tokens appended for each
observation show which state the environment was handed.
"""

from __future__ import annotations

import grpc
from environment_service import serve_environment

from services.common.config import load_config
from services.common.pb.flywheel.v1 import environment_pb2_grpc, types_pb2
from services.common.structs import to_struct
from services.environment.base import make_environment
from services.rollout.engines.hf import HFEngine
from services.rollout.episodes import EpisodeRunner

TURNS = 3


async def test_each_turn_hands_the_environment_the_state_its_last_step_returned():
    cfg = load_config(None, ["policy.max_total_sequence_length=1024", "policy.generation.max_new_tokens=4"])
    server, port = await serve_environment()
    engine = HFEngine(cfg, "multi-turn")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            runner = EpisodeRunner(engine, environment_pb2_grpc.EnvironmentServiceStub(channel),
                                   generation=cfg.policy.generation,
                                   max_seq_len=cfg.policy.max_total_sequence_length,
                                   step_timeout_s=cfg.rollout.step_timeout_s)
            row = make_environment("sliding_puzzle").prompts(1, seed=0, offset=0)[0]
            max_moves = row["metadata"]["max_moves"]
            group = types_pb2.PromptGroup(
                group_id="g0", prompt_id="p0", env_name="sliding_puzzle", num_generations=2, max_turns=TURNS,
                messages=[types_pb2.ChatMessage(**m) for m in row["messages"]], metadata=to_struct(row["metadata"]))
            traj = await runner.run(group, "multi-turn")
    finally:
        await server.stop(0)

    assert len(traj.completions) == 2
    for c in traj.completions:
        # A random tiny model does not solve the board, so every episode plays all its turns: the last Step
        # ends it, and the observations of the turns before it are appended as tokens the loss ignores.
        assert c.turns == TURNS, c
        observations, run = [], []
        for token, generated in zip(c.token_ids, c.generated_mask):
            if not generated:
                run.append(token)
            elif run:
                observations.append(engine.tokenizer.decode(run))
                run = []
        assert len(observations) == TURNS - 1, observations
        for turn, text in enumerate(observations, start=1):
            assert f"left: {max_moves - turn}." in text, (turn, text)  # the tiny vocabulary has no capitals
