"""One long-lived verifiers runner serving many episodes (VerifiersAgent's `runner: shared`).

A runner per episode (the default) pays for a fresh Python importing verifiers, and for the env's tool servers,
on every episode: about 10 s of CPU each on a 2-core machine, most of an episode of a small model. The shared
runner (`verifiers_runner.py --serve`) pays that once: it holds `env.serving()` (the taskset's shared tool servers)
and runs the episodes it is sent concurrently, each still starting its harness program and its task's own tool
servers, as verifiers does in its own evals.

What it gives up is the process-group isolation: at its deadline an episode's task is cancelled inside the runner,
and whatever that leaves running (a program its rubric started; its harness program, if verifiers' cancellation
does not stop it, which is not tested here) is killed only with the runner, at `close`; a rubric that blocks the
event loop stalls every episode. A runner that dies fails the episodes it held (AgentError) and the next
episode starts a new one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json

from services.environment.agents import AgentError
from services.environment.agents.verifiers_agent import kill_group, runner_command

STDERR_TAIL = 50  # lines of the runner's stderr kept for the error of a runner that died


class SharedRunner:
    """The one `--serve` process of an agent, started at the first episode (and again after it dies)."""

    def __init__(self, spec: dict, env: dict) -> None:
        self.spec, self.env = spec, env
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._readers: list[asyncio.Task] = []

    async def run(self, request: dict, deadline_s: float) -> dict:
        """The runner's answer to one episode request (the answer dict of verifiers_runner.py), or AgentError."""
        episode_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[episode_id] = answer
        try:
            proc = await self._started()
            await self._send(proc, {**request, "id": episode_id})
            return await asyncio.wait_for(asyncio.shield(answer), deadline_s)
        except TimeoutError:
            if self._proc is not None and self._proc.returncode is None:
                await self._send(self._proc, {"id": episode_id, "cancel": True})
            raise AgentError(f"verifiers episode passed its {deadline_s:g}s deadline") from None
        finally:
            self._pending.pop(episode_id, None)

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            await kill_group(proc)
        for task in self._readers:
            task.cancel()

    async def _started(self) -> asyncio.subprocess.Process:
        async with self._lock:  # concurrent first episodes start one runner
            if self._proc is None or self._proc.returncode is not None:
                argv, env = runner_command(self.spec)
                self._proc = await asyncio.create_subprocess_exec(
                    *argv, "--serve", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True, limit=2**24)
                await self._send(self._proc, {"env": self.env})
                self._readers = [asyncio.create_task(self._answers(self._proc)),
                                 asyncio.create_task(self._errors(self._proc))]
            return self._proc

    @staticmethod
    async def _send(proc: asyncio.subprocess.Process, message: dict) -> None:
        try:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the runner died: its reader fails the episodes it held

    async def _answers(self, proc: asyncio.subprocess.Process) -> None:
        """Hand each answer line to its episode; at the runner's end fail the episodes still waiting."""
        while line := await proc.stdout.readline():
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:
                continue  # something in the runner printed to stdout; answers are whole JSON lines
            waiting = self._pending.get(answer.pop("id", None)) if isinstance(answer, dict) else None
            if waiting is not None and not waiting.done():
                waiting.set_result(answer)
        held = list(self._pending.values())  # before a next runner can start and take new episodes
        await proc.wait()
        error = AgentError(f"the verifiers runner exited ({proc.returncode}): {''.join(self._stderr)[-2000:]}")
        for waiting in held:
            if not waiting.done():
                waiting.set_exception(error)

    async def _errors(self, proc: asyncio.subprocess.Process) -> None:
        while line := await proc.stderr.readline():  # drained, or a chatty runner would block on a full pipe
            self._stderr.append(line.decode(errors="replace"))
