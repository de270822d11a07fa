"""The any-program agent: a command run once per episode that talks the OpenAI API and prints its reward.

The contract (docs/agents.md, "Any program"):

- environment: `OPENAI_BASE_URL` (the episode's base URL), `OPENAI_API_KEY` (its token), `OPENAI_MODEL`
  (the name to put in requests), besides the service's own environment and the spec's `env`;
- stdin: the task as one JSON object (the prompt's dataset row: `messages` and the row's other fields); with
  `task_file: true` stdin is empty and `FLYWHEEL_TASK_FILE` names a file holding that JSON instead;
- stdout: the last non-empty line is the result, `{"reward": <finite number>, "metrics": {name: number}}`
  (`metrics` optional); earlier lines are the program's own and ignored;
- exit status 0. Anything else fails the episode: a non-zero exit is a `crash`, a last line that is not such
  an object a `malformed_reward`.

The deadline is the environment service's (it cancels `run`): the program's whole process group is killed
then, so a hung agent and anything it started stop with its episode. Calls it still makes after that are
refused by the endpoint (410), because rollout closes the episode once RunAgent returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import tempfile

from services.environment.agents import Agent, AgentEpisode, AgentError, AgentResult

STDERR_KEPT = 2000
"""Characters of a failed program's stderr kept in the error."""
MAX_OUTPUT = 1 << 20
"""Bytes of stdout (and of stderr) kept at most: the result is one line."""
EXIT_POLL_S = 0.05
PIPE_GRACE_S = 1.0
"""Seconds to finish reading a program's output after it exited."""


class ProgramAgent(Agent):
    def __init__(self, *, command: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 task_file: bool = False) -> None:
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"command must be a non-empty list of strings (argv), got {command!r}")
        self.command = list(command)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd = cwd
        self.task_file = task_file

    async def run(self, episode: AgentEpisode) -> AgentResult:
        task = json.dumps(episode.task).encode()
        with _task_file(task if self.task_file else None) as path:
            env = {**os.environ, **self.env, "OPENAI_BASE_URL": episode.base_url,
                   "OPENAI_API_KEY": episode.api_key, "OPENAI_MODEL": episode.model}
            if path:
                env["FLYWHEEL_TASK_FILE"] = path
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)
            except OSError as err:  # no such program, not executable
                raise AgentError(f"cannot start {self.command[0]}: {err}", reason="crash") from None
            try:
                out, err = await _talk(proc, b"" if path else task)
            finally:
                _kill_group(proc)  # cancelled at the deadline, or children left behind
        if proc.returncode != 0:
            tail = err.decode(errors="replace")[-STDERR_KEPT:]
            raise AgentError(f"{self.command[0]} exited with status {proc.returncode}: {tail}", reason="crash")
        return parse_result(out.decode(errors="replace"))


def parse_result(stdout: str) -> AgentResult:
    """The last non-empty line of a program's stdout as an AgentResult; AgentError(malformed_reward) if it is
    not `{"reward": finite number, "metrics": {str: finite number}}`."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict) or not _finite(result.get("reward")):
        raise AgentError(f"the last line of stdout must be {{\"reward\": <finite number>, \"metrics\": {{...}}}}, "
                         f"got {(lines[-1] if lines else '')[:200]!r}", reason="malformed_reward")
    metrics = result.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and _finite(v) for k, v in metrics.items()):
        raise AgentError(f"metrics must map names to finite numbers, got {str(metrics)[:200]}",
                         reason="malformed_reward")
    return AgentResult(reward=float(result["reward"]), metrics={k: float(v) for k, v in metrics.items()})


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


async def _talk(proc: asyncio.subprocess.Process, task: bytes) -> tuple[bytes, bytes]:
    """Feeds the task, waits for the program to exit and returns what it wrote. Waits for its exit, not for the
    end of its output: a child it left running in another session may hold the pipes open for ever."""
    out, err = bytearray(), bytearray()
    readers = [asyncio.create_task(_read(proc.stdout, out)), asyncio.create_task(_read(proc.stderr, err))]
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program that reads no task
            proc.stdin.write(task)
            await proc.stdin.drain()
            proc.stdin.close()
        while proc.returncode is None:  # not proc.wait(): before Python 3.12 it also waits for the pipes to close
            await asyncio.sleep(EXIT_POLL_S)
        await asyncio.wait(readers, timeout=PIPE_GRACE_S)
    finally:
        for reader in readers:
            reader.cancel()
    return bytes(out), bytes(err)


async def _read(stream: asyncio.StreamReader, into: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        if len(into) < MAX_OUTPUT:
            into += chunk[:MAX_OUTPUT - len(into)]


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def _task_file(task: bytes | None):
    if task is None:
        yield None
        return
    with tempfile.NamedTemporaryFile(prefix="flywheel-task-", suffix=".json") as f:
        f.write(task)
        f.flush()
        yield f.name
