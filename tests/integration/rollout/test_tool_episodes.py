"""Tool calls through the rollout's episode loop: both real engines (the tiny model, briefly trained on one
demonstration so that it calls the tool), vLLM's hermes parser, and a real environment service running tool_add."""

from __future__ import annotations

import json

import grpc
import pytest
from engine_harness import Trainer
from environment_service import serve_environment
from tool_demos import warm_start

from services.common.config import load_config
from services.common.messages import tool_from_dict
from services.common.modeling import load_policy
from services.common.pb.flywheel.v1 import environment_pb2_grpc, types_pb2
from services.common.structs import to_struct
from services.environment.envs.tool_add import ADD_TOOL
from services.rollout.engines import Engine, make_engine
from services.rollout.episodes import EpisodeRunner
from services.rollout.flaws import INVALID_TOOL_CALL
from services.rollout.tools import parse_tool_calls

pytestmark = pytest.mark.slow  # the brief training takes a minute or more on two shared cores
G = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_start(tmp_path_factory.mktemp("tool_model"), steps=80, answer_fraction=1.0, pairs=[(3, 4)], batch=4,
                      threads=1)


async def _episodes(model_dir, tool_parser: str | None, backend: str = "hf"
                    ) -> tuple[types_pb2.TrajectoryGroup, Engine]:
    overrides = [f"policy.model_name={model_dir}", "policy.max_total_sequence_length=256",
                 "policy.generation.max_new_tokens=80", "policy.generation.temperature=0.05",
                 f"policy.generation.backend={backend}", f"policy.generation.tool_parser={tool_parser or 'null'}"]
    cfg = load_config(None, overrides)
    engine = make_engine(cfg, "tools")
    await engine.start()
    trainer = Trainer("tools")
    await trainer.push(engine, 0, load_policy(cfg.policy, cfg.run.seed)[0])  # vLLM starts from dummy weights
    server, port = await serve_environment()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            runner = EpisodeRunner(engine, environment_pb2_grpc.EnvironmentServiceStub(channel),
                                   generation=cfg.policy.generation, max_seq_len=256, step_timeout_s=30)
            group = types_pb2.PromptGroup(
                group_id="g", prompt_id="p", env_name="tool_add", num_generations=G, max_turns=3,
                messages=[types_pb2.ChatMessage(role="user", content="add 3 4")], tools=[tool_from_dict(ADD_TOOL)],
                metadata=to_struct({"ground_truth": "7"}))
            return await runner.run(group, "tools"), engine
    finally:
        await server.stop(0)
        trainer.close()
        await engine.close()


def _runs(c: types_pb2.Completion) -> list[tuple[bool, list[int]]]:
    """The completion's tokens cut into runs of generated / not generated."""
    runs: list[tuple[bool, list[int]]] = []
    for token, generated in zip(c.token_ids, c.generated_mask, strict=True):
        if not runs or runs[-1][0] != generated:
            runs.append((generated, []))
        runs[-1][1].append(token)
    return runs


@pytest.mark.parametrize("backend", ["hf", "vllm"])
async def test_the_model_calls_the_tool_gets_its_result_as_masked_tokens_and_answers(model_dir, backend):
    group, engine = await _episodes(model_dir, "hermes", backend)
    tok = engine.tokenizer
    assert tok.decode(group.prompt_token_ids) == "<bos>tools: add(a,b)\nu:add 3 4\na:"  # the template with tools
    for c in group.completions:
        assert c.turns == 2 and c.reward == 1.0, c.text
        (g1, call), (g2, result), (g3, answer) = _runs(c)
        assert (g1, g2, g3) == (True, False, True)
        _, calls = parse_tool_calls(tok.decode(call, skip_special_tokens=True), parser="hermes", tokenizer=tok,
                                    tools=[ADD_TOOL])
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
            ("add", {"a": 3, "b": 4})]
        assert tok.decode(result) == "t:7\na:"  # the tool message as the chat template writes it, loss mask 0
        assert tok.decode(answer, skip_special_tokens=True) == "7"
        assert all(lp == 0.0 for lp, m in zip(c.generation_logprobs, c.generated_mask) if not m)
        assert list(c.flaws) == []  # a call the parser read, an answer without markup: sound turns


async def test_without_a_tool_parser_the_call_stays_text_and_the_task_is_not_solved(model_dir):
    """The call left as text is what NeMo RL flags an invalid tool call: every token of the turn carries the flag."""
    group, _ = await _episodes(model_dir, None)
    for c in group.completions:
        assert c.turns == 1 and c.reward == 0.0 and "<tool_call>" in c.text
        assert list(c.flaws) == [INVALID_TOOL_CALL if g else 0 for g in c.generated_mask]
