"""NeMo RL's `gdpo_example_tool_call_multireward.yaml` trains through `flywheel up` with its documented edit
(docs/nemo_rl_mapping.md) and the CPU overrides below: `env.nemo_gym` becomes a `nemo_gym` agent environment, whose
ng_run (NeMo Gym's own servers from `.venv-gym`) runs each episode against the rollout worker's endpoint, and
`data.train`'s NemoGymDataset, read from the nemo-gym package, is its dataset. The trainer steps with GDPO on the
reward components NeMo Gym's /verify gives.

The oracle is NeMo Gym's own resources server: for every completion of the batches the trainer consumed (replay's
chosen groups in Redis), this test sends the answer to that server's /verify with the task row the controller
leased for the group (its prompt id), and the completion must carry the reward and reward components it answers.
The group's prompt must be that row's. The tiny model never writes a tool call, so every reward is 0 here: the run
shows NeMo Gym episodes recorded and trained on, not learning.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from needs import require
from oracles import consumed_groups
from services.common.config import load_config
from services.common.nemo_rl_gym import gym_venv
from services.common.tokenizing import load_tokenizer_without_torch
from services.environment.agents.nemo_gym_tasks import read_tasks
from services.local import LocalStack

pytestmark = pytest.mark.slow
require((gym_venv() / "bin" / "ng_run").exists(), "no .venv-gym: run `make gym-venv`")
NEMO_RL = Path(__file__).parents[1] / "fixtures/nemo_rl/examples/nemo_gym/gdpo_example_tool_call_multireward.yaml"
EDITS = ["policy.generation.colocated.enabled=false"]
STEPS = 2
# CPU and size: the tiny model on the hf engine with FSDP2 (Megatron's forward needs CUDA), short answers, a few
# groups, no checkpoints or W&B. nemotron_json is NeMo RL's plugin parser for Nemotron, not one of vLLM's.
CPU = ["policy.model_name=tiny", "policy.precision=float32", "policy.megatron_cfg.enabled=false",
       "policy.dtensor_cfg.enabled=true", "policy.dtensor_cfg.tensor_parallel_size=1",
       "++policy.optimizer.name=torch.optim.AdamW", "++policy.optimizer.kwargs.lr=1.0e-4", "policy.max_total_sequence_length=512",
       "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
       "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser=null",
       "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", f"grpo.max_num_steps={STEPS}",
       "checkpointing.enabled=false", "logger.wandb_enabled=false",
       "data.validation=null"]  # validation on NeMo Gym is test_nemo_gym_collect_e2e.py's (the same Generate path)
RESOURCES = "example_tool_call_multireward"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _head_gone(port: int) -> bool:
    for _ in range(50):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return True
        time.sleep(0.2)
    return False


async def _verify(head: str, row: dict, text: str) -> dict:
    """NeMo Gym's resources server's own /verify of `text` as the episode's answer (found through ng_run's head
    server, whose port this test chose)."""
    output = [{"type": "message", "role": "assistant", "id": "msg_ref", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
    response = {"id": "resp_ref", "created_at": 0, "model": "policy", "object": "response", "output": output,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{head}/server_instances") as r:
            url = next(i["url"] for i in await r.json() if i["process_name"] == RESOURCES)
        async with http.post(f"{url}/verify", json=row | {"response": response}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def test_nemo_rls_gdpo_nemo_gym_config_trains_on_nemo_gym_episodes(tmp_path):
    head = _free_port()
    cfg = load_config(NEMO_RL, EDITS + CPU + ["++env.nemo_gym.head_server.host=127.0.0.1",
                                             f"++env.nemo_gym.head_server.port={head}"])
    [env] = cfg.environments
    assert env.kind == "agent" and env.agent["type"] == "nemo_gym" and cfg.policy.generation.endpoint.enabled
    tasks = read_tasks(env.dataset)  # the dataset the config names, as NeMo Gym rows
    tokenizer = load_tokenizer_without_torch(cfg.policy)
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
        groups = consumed_groups(stack.redis.url, stack.cfg)
        checks = [(g, c, tasks[int(g.prompt_id.rsplit("/", 1)[1]) % len(tasks)]) for g in groups for c in g.completions]
        references = asyncio.run(_all(f"http://127.0.0.1:{head}", checks, tokenizer))
    assert _head_gone(head)  # the environment service stopped ng_run (its own session) with itself
    assert all("train/reward_mean/nemo_gym" in r for r in rows)
    assert len(groups) >= STEPS * cfg.grpo.num_prompts_per_step and all(g.env_name == "nemo_gym" for g in groups)
    assert len({g.prompt_id for g in groups}) >= 2  # the controller walked the dataset
    for (g, c, task), reference in zip(checks, references):
        # The leased row's prompt (the tiny vocabulary has no capitals: compare the user message's tail).
        assert task["messages"][-1]["content"][-6:] in tokenizer.decode(g.prompt_token_ids)
        assert sum(c.generated_mask) > 0
        assert c.reward == pytest.approx(reference["reward"])
        assert dict(c.named_rewards) == pytest.approx(reference["reward_components"])


async def _all(head: str, checks, tokenizer) -> list[dict]:
    out = []
    for _, c, task in checks:
        text = tokenizer.decode([t for t, m in zip(c.token_ids, c.generated_mask) if m], skip_special_tokens=True)
        out.append(await _verify(head, task["nemo_gym"], text))
    return out
