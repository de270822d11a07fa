"""`flywheel collect` on NeMo RL's `examples/nemo_gym/gdpo_example_tool_call_multireward.yaml` (its one documented
edit and the CPU overrides of test_nemo_gym_e2e.py): its NemoGymDataset validation set is the prompts, and NeMo
Gym's own simple agent and resources server (ng_run, from `.venv-gym`) run every episode against rollout's
endpoint. The oracles are NeMo Gym's: its model and aggregation of rollouts.jsonl, and its resources server's own
`verify` (the class from the nemo-gym package, run in `.venv-gym` with the task row and the line's response),
which must give each line's reward and reward components. The untrained tiny model never calls the tool, so those
are all 0 here: the test shows the rewards are /verify's for what was recorded, not that they can be positive."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gym_schema import VENV, nemo_gym_reads
from needs import require

from services.common.nemo_rl_gym import gym_venv

pytestmark = pytest.mark.slow  # ng_run's servers start in each run: about 50 s on 2 shared cores
require((gym_venv() / "bin" / "ng_run").exists(), "no .venv-gym: run `make gym-venv`")
NEMO_RL = "tests/fixtures/nemo_rl/examples/nemo_gym/gdpo_example_tool_call_multireward.yaml"
SERVER = gym_venv() / "lib/python3.12/site-packages/resources_servers/example_tool_call_multireward"
CPU = ["policy.generation.colocated.enabled=false", "policy.model_name=tiny", "policy.precision=float32",
       "policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true",
       "policy.dtensor_cfg.tensor_parallel_size=1", "++policy.optimizer.name=torch.optim.AdamW",
       "policy.max_total_sequence_length=512", "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
       "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser=null", "logger.wandb_enabled=false"]
PROMPTS, N = 2, 2
VERIFY = """
import asyncio, json, sys
from unittest.mock import MagicMock
sys.path.insert(0, sys.argv[1])
from app import ToolCallMultiRewardResourcesServer as Server, ToolCallMultiRewardResourcesServerConfig as Config
from app import ToolCallMultiRewardVerifyRequest as Request
from nemo_gym.server_utils import ServerClient
server = Server(config=Config(host="127.0.0.1", port=0, entrypoint="", name=""),
                server_client=MagicMock(spec=ServerClient))
rows = [json.loads(line) for line in open(sys.argv[2])]
for line in map(json.loads, open(sys.argv[3])):
    task = rows[line["_ng_task_index"]]
    verified = asyncio.run(server.verify(Request.model_validate(task | {"response": line["response"]})))
    print(json.dumps({"reward": verified.reward, **verified.reward_components}))
"""


def test_collect_on_nemo_rls_nemo_gym_config_writes_episodes_that_nemo_gyms_verify_scores_as_written(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "collect", "--config", NEMO_RL, "--n", str(N), "--out", str(out),
         "--run-dir", str(tmp_path / "run"), f"grpo.max_val_samples={PROMPTS}", *CPU],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == PROMPTS * N and {line["env_name"] for line in lines} == {"nemo_gym"}
    assert nemo_gym_reads(out) == (PROMPTS * N, pytest.approx(sum(line["reward"] for line in lines) / len(lines)))
    assert all(line["response"]["output"] for line in lines)  # the recorded episode, not an empty one
    verify = subprocess.run([str(VENV / "bin" / "python"), "-c", VERIFY, str(SERVER),
                             str(SERVER / "data/example.jsonl"), str(out)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr[-3000:]
    for line, verified in zip(lines, map(json.loads, verify.stdout.splitlines()), strict=True):
        assert {k: line[k] for k in verified} == verified, line
