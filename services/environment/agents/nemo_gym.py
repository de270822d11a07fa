"""NeMo Gym environments as Flywheel agents (docs/agents.md, "NeMo Gym").

NeMo Gym runs as NeMo Gym runs itself: `ng_run` from its own venv (`.venv-gym`, Python 3.12, with Ray, hydra
and mlflow, none of which Flywheel imports) starts its head, model, resources and agent servers once. Per
episode we POST the task row to the agent server's `/run`; NeMo Gym's agent calls its model server, the
resources server's tools, then `/verify`, whose `reward` is the episode's reward and whose other numbers are
its metrics.

NeMo Gym's model server (`vllm_model`) has one fixed `base_url` and `api_key`, but every Flywheel episode has
its own session URL and token. So the model server points at a pass-through we run here, and each episode's
`responses_create_params.metadata` carries an opaque episode id, which `vllm_model` forwards to chat
completions untouched; the pass-through swaps it for that episode's URL and token. The token never enters NeMo
Gym, and a call for an episode that has ended finds no route (404) and never reaches another episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from services.common.nemo_rl_gym import gym_venv
from services.environment.agents import Agent, AgentEpisode, AgentError, AgentResult
from services.environment.agents.nemo_gym_tasks import task_row

log = logging.getLogger(__name__)
EPISODE_KEY = "flywheel_episode"
STOP_GRACE_S = 1.5
"""Seconds ng_run gets to shut its servers and Ray down on SIGINT before its session is killed."""
SERVER_KINDS = ("resources_servers", "responses_api_agents", "responses_api_models")


@dataclass(kw_only=True)
class NemoGymSpec:
    """What NeMo RL's `env.nemo_gym` gives: NeMo Gym config paths, `vllm_model_for_training` first."""

    config_paths: list[str]
    agent: str | None = None
    """The agent server's config name (NeMo Gym's `agent_ref.name`); default: the row's `agent_ref`, else the
    only agent."""
    venv: Path = field(default_factory=gym_venv)
    overrides: dict[str, object] = field(default_factory=dict)
    """Extra NeMo Gym global config (`key=value` on ng_run's command line)."""
    startup_s: float = 300.0

    def __post_init__(self) -> None:
        self.venv = Path(self.venv)
        paths = self.config_paths
        if not paths or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"config_paths must be a non-empty list of NeMo Gym config paths, got {paths!r}")
        if not (self.venv / "bin" / "ng_run").exists():
            raise ValueError(f"no NeMo Gym in {self.venv} (make gym-venv)")


class NemoGymAgent(Agent):
    """One `ng_run` (its servers started once) serving many concurrent episodes. Built from a spec's fields
    (the registry's `{"type": "nemo_gym", "config_paths": [...], ...}`) or a NemoGymSpec."""

    def __init__(self, spec: NemoGymSpec | None = None, **fields) -> None:
        self.spec = spec or NemoGymSpec(**fields)
        self.routes: dict[str, AgentEpisode] = {}
        self.key = secrets.token_urlsafe(24)  # what NeMo Gym's model server sends the pass-through
        self.workdir = Path(tempfile.mkdtemp(prefix="flywheel-gym-"))
        self.proc: asyncio.subprocess.Process | None = None
        self.runner: web.AppRunner | None = None
        self.http: aiohttp.ClientSession | None = None
        self.servers: dict[str, str] = {}  # NeMo Gym config name -> url
        self.agents: list[str] = []
        self.starting: asyncio.Task | None = None
        # Registered on a running loop (the environment service): start now, not inside the first episode.
        with contextlib.suppress(RuntimeError):
            self.starting = asyncio.get_running_loop().create_task(self._start())

    async def start(self) -> None:
        """Until the servers are up; a failed start fails every episode with its error (no restart storm)."""
        if self.starting is None:
            self.starting = asyncio.create_task(self._start())
        await asyncio.shield(self.starting)

    async def _start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        proxy_url = await self._start_proxy()
        head = int((self.spec.overrides.get("head_server") or {}).get("port") or _free_port())
        log = open(self.workdir / "ng_run.log", "wb")
        self.proc = await asyncio.create_subprocess_exec(
            str(self.spec.venv / "bin" / "ng_run"), *self._args(proxy_url, head), cwd=self.workdir,
            stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            await asyncio.wait_for(self._wait_ready(f"http://127.0.0.1:{head}"), self.spec.startup_s)
        except BaseException:
            await self.close()
            raise

    def _args(self, proxy_url: str, head: int) -> list[str]:
        _link_server_venvs(self.spec.venv, self.workdir / "venvs")
        values = {"config_paths": list(self.spec.config_paths), "policy_base_url": proxy_url,
                  "policy_api_key": self.key, "policy_model_name": "policy",
                  # Each server runs in .venv-gym (linked per server): ng_run would otherwise build a uv
                  # venv per server from the index at every start.
                  "skip_venv_if_present": True, "uv_venv_dir": str(self.workdir / "venvs"),
                  "head_server": {"host": "127.0.0.1", "port": head}, "default_host": "127.0.0.1",
                  **self.spec.overrides}
        return [f"++{k}={_hydra(v)}" for k, v in _flatten(values).items()]

    async def _wait_ready(self, head_url: str) -> None:
        """Until every server ng_run started answers HTTP (as NeMo Gym's own spin-up check does)."""
        while True:
            if self.proc.returncode is not None:
                raise AgentError(f"ng_run exited with {self.proc.returncode}: {self.log_tail()}", "crash")
            instances = await self._get_json(f"{head_url}/server_instances")
            if instances and all([await self._answers(i["url"]) for i in instances]):
                self.servers = {i["process_name"]: i["url"] for i in instances}
                self.agents = [i["process_name"] for i in instances
                               if i["server_type"] == "responses_api_agents"]
                return
            await asyncio.sleep(1.0)

    async def _get_json(self, url: str):
        try:
            async with self.http.get(url) as r:
                return await r.json() if r.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def _answers(self, url: str) -> bool:
        try:
            async with self.http.get(url):
                return True
        except aiohttp.ClientError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        return (self.workdir / "ng_run.log").read_text(errors="replace")[-chars:]

    async def run(self, episode: AgentEpisode) -> AgentResult:
        try:
            await self.start()
        except TimeoutError:
            raise AgentError(f"NeMo Gym servers not up within {self.spec.startup_s:g} s") from None
        row = copy.deepcopy(task_row(episode.task))
        url = f"{self.servers[self._agent_for(row)]}/run"
        episode_id = secrets.token_hex(16)
        params = row.setdefault("responses_create_params", {})
        params["metadata"] = {**(params.get("metadata") or {}), EPISODE_KEY: episode_id}
        self.routes[episode_id] = episode
        try:
            verified = await asyncio.wait_for(self._post(url, row), episode.deadline_s)
        except TimeoutError:
            raise AgentError(f"NeMo Gym episode past its {episode.deadline_s}s deadline",
                             "deadline") from None
        finally:
            self.routes.pop(episode_id, None)  # late calls of this episode now find no route
        return to_result(verified, row)

    def _agent_for(self, row: dict) -> str:
        name = self.spec.agent or (row.get("agent_ref") or {}).get("name")
        if name is None and len(self.agents) == 1:
            name = self.agents[0]
        if name not in self.agents:
            raise AgentError(f"no NeMo Gym agent {name!r} among {self.agents}")
        return name

    async def _post(self, url: str, row: dict) -> dict:
        try:
            async with self.http.post(url, json=row) as r:
                body = await r.text()
        except aiohttp.ClientError as e:
            raise AgentError(f"NeMo Gym agent server unreachable: {e}", "crash") from e
        if r.status != 200:
            raise AgentError(f"NeMo Gym /run answered {r.status}: {body[:2000]}")
        try:
            return json.loads(body)
        except json.JSONDecodeError as e:
            raise AgentError(f"NeMo Gym /run answered non-JSON: {body[:200]!r}") from e

    async def _start_proxy(self) -> str:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/{route:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _forward(self, request: web.Request) -> web.Response:
        """NeMo Gym's model server -> this episode's session on Flywheel's endpoint."""
        if not secrets.compare_digest(request.headers.get("Authorization", ""), f"Bearer {self.key}"):
            return _error(401, "invalid_api_key", "not NeMo Gym's model server")
        body = await request.json()
        metadata = body.get("metadata") or {}
        episode = self.routes.get(metadata.pop(EPISODE_KEY, None))
        if episode is None:
            log.warning("NeMo Gym model call for no open episode (%s)", request.path)
            return _error(404, "session_not_found", "no open Flywheel episode for this call")
        body["model"] = episode.model
        # The endpoint then puts NeMo Gym's token fields on the message, so NeMo Gym's vllm_model takes them
        # as they are instead of asking vLLM's /tokenize (which the endpoint does not serve) for the prompt.
        body.setdefault("return_token_ids", True)
        if not metadata:
            body.pop("metadata", None)
        headers = {"Authorization": f"Bearer {episode.api_key}"}
        try:
            async with self.http.post(f"{episode.base_url}/{request.match_info['route']}", json=body,
                                      headers=headers) as r:
                answer = await r.read()
        except aiohttp.ClientError as e:
            return _error(502, "endpoint_unreachable", f"Flywheel's endpoint: {e}")
        if r.status != 200:
            log.warning("endpoint answered NeMo Gym's call with %s: %s", r.status, answer[:500])
        return web.Response(status=r.status, body=answer, content_type=r.content_type)

    async def close(self) -> None:
        """SIGINT is ng_run's own shutdown (servers, then its Ray cluster); past STOP_GRACE_S every process of its
        session is killed: ng_run's shutdown signals each server's bash wrapper, a server whose wrapper it kills
        would live on orphaned, and Ray's workers lead process groups of their own. The grace is short because
        the environment service closes its agents inside its own stop grace (services/local.py waits 5 s)."""
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()
            with contextlib.suppress(BaseException):
                await self.starting
        if self.proc is not None:
            try:
                if self.proc.returncode is None:
                    self.proc.send_signal(signal.SIGINT)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
            finally:
                kill_session(self.proc.pid)
            await self.proc.wait()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (Linux: read from /proc), the session leader's group first."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp session
        except OSError:
            continue
        if int(fields[3]) == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def to_result(verified: dict, row: dict) -> AgentResult:
    """/verify's answer: `reward`; its `reward_components` as the named rewards GDPO reads (NeMo RL's bridge
    does the same); and as metrics its other top-level numbers that the task row did not bring."""
    reward = verified.get("reward")
    if not _is_number(reward):
        raise AgentError(f"NeMo Gym /verify gave a malformed reward: {reward!r}", "malformed_reward")
    components = verified.get("reward_components") or {}
    if not isinstance(components, dict) or not all(_is_number(v) for v in components.values()):
        raise AgentError(f"NeMo Gym /verify gave malformed reward_components: {components!r}", "malformed_reward")
    metrics = {k: float(v) for k, v in verified.items()
               if k != "reward" and k not in row and _is_number(v)}
    return AgentResult(reward=float(reward), metrics=metrics,
                       named_rewards={k: float(v) for k, v in components.items()})


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _link_server_venvs(venv: Path, root: Path) -> None:
    """`<root>/<kind>/<server>/.venv` -> the NeMo Gym venv, for every server the package ships."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    for kind in SERVER_KINDS:
        for server in (site / kind).iterdir():
            if server.is_dir() and not server.name.startswith("__"):
                (root / kind / server.name).mkdir(parents=True, exist_ok=True)
                link = root / kind / server.name / ".venv"
                if not link.exists():
                    link.symlink_to(venv.resolve())


def _flatten(values: dict, prefix: str = "") -> dict:
    """Nested mappings as dotted keys, so an override sets its leaves and keeps the config's siblings."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _hydra(value) -> str:
    """A value in Hydra's override grammar (JSON but for unquoted dict keys)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        # A spec that came over gRPC (a Struct) holds every number as a double; NeMo Gym's ports and counts
        # must be integers, and a float field takes an integer as well.
        return str(int(value))
    return json.dumps(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": code}}, status=status)
