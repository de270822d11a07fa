"""data.max_input_seq_length through the rollout's EpisodeRunner, with a real tiny HF engine and a real
environment service: a prompt at the limit is kept out of the loss (NeMo RL's loss_multiplier 0), one under it
is generated on and scored as usual."""

from __future__ import annotations

import grpc
from environment_service import serve_environment

from services.common.config import load_config
from services.common.pb.flywheel.v1 import environment_pb2_grpc, types_pb2
from services.rollout.engines.hf import HFEngine
from services.rollout.episodes import KEPT_PROMPT_TOKENS, PROMPTS_TOO_LONG, EpisodeRunner, prompt_token_ids

LIMIT = 24


def _group(gid: str, text: str) -> types_pb2.PromptGroup:
    return types_pb2.PromptGroup(group_id=gid, prompt_id=gid, env_name="toy_copy", num_generations=3, max_turns=1,
                                 messages=[types_pb2.ChatMessage(role="user", content=text)])


async def test_a_prompt_at_the_limit_gets_empty_truncated_completions_and_a_short_prompt_is_generated_on():
    cfg = load_config(None, [f"data.max_input_seq_length={LIMIT}", "policy.generation.max_new_tokens=4"])
    server, port = await serve_environment()
    engine = HFEngine(cfg, "limit")
    short, long = "copy 3", "copy " + "7" * 40
    sizes = [len(prompt_token_ids(engine.tokenizer, [{"role": "user", "content": t}])) for t in (short, long)]
    assert sizes[0] < LIMIT <= sizes[1]
    before = PROMPTS_TOO_LONG._value.get()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            runner = EpisodeRunner(engine, environment_pb2_grpc.EnvironmentServiceStub(channel),
                                   generation=cfg.policy.generation,
                                   max_seq_len=cfg.policy.max_total_sequence_length,
                                   max_prompt_len=cfg.data.max_input_seq_length,
                                   step_timeout_s=cfg.rollout.step_timeout_s)
            kept = await runner.run(_group("short", short), "limit")
            dropped = await runner.run(_group("long", long), "limit")
    finally:
        await server.stop(0)

    assert len(kept.prompt_token_ids) == sizes[0]
    assert all(c.turns == 1 and any(c.generated_mask) for c in kept.completions)
    assert len(dropped.prompt_token_ids) == KEPT_PROMPT_TOKENS and len(dropped.completions) == 3
    for c in dropped.completions:
        assert (c.turns, list(c.token_ids), c.reward, c.truncated) == (0, [], 0.0, True)
        assert c.version_start == c.version_end == engine.version
    assert dropped.version_start == engine.version
    assert PROMPTS_TOO_LONG._value.get() == before + 1
