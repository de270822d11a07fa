"""The endpoint a rollout worker serves: uvicorn on the worker's event loop, and the episode API it calls.

    endpoint = EndpointServer(cfg, engine, worker_id); await endpoint.start()
    key, token, base_url = endpoint.open_episode(metadata={...})   # hand base_url + token to the agent
    ...the agent calls base_url with the OpenAI SDK (api_key=token)...
    trajectory = endpoint.close_episode(key)                        # samples to publish with the group

It listens on policy.generation.endpoint.host (loopback unless configured) and port (0: a free one), with TLS
when security.tls_cert is set (client certificates required under security.tls_mutual), as the gRPC servers
do.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn

from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import types_pb2
from services.rollout.endpoint.app import make_app
from services.rollout.endpoint.chat import Chat
from services.rollout.endpoint.completions import Completions
from services.rollout.endpoint.generation import Generator, with_environment
from services.rollout.endpoint.sessions import Limits, Sessions
from services.rollout.endpoint.trajectory import Trajectory
from services.rollout.engines import Engine

log = logging.getLogger("flywheel.rollout.endpoint")


class EndpointServer:
    def __init__(self, cfg: FlywheelConfig, engine: Engine, worker_id: str) -> None:
        self.cfg = cfg
        self.settings = cfg.policy.generation.endpoint
        self.sessions = Sessions()
        self.generator = generator = Generator(engine, cfg.policy.generation, worker_id)
        name = cfg.policy.model_name
        self.app = make_app(self.sessions, Chat(generator, engine.tokenizer, cfg.policy.generation, name),
                            Completions(generator, engine.tokenizer, name), name,
                            cfg.security.max_message_mb << 20)
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None
        self.base_url = ""

    async def start(self) -> str:
        """Listen and serve; returns the base URL (scheme, host, port) without a session."""
        security = self.cfg.security
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
        # uvicorn writes a response's head and body apart, so under Nagle the body waits for the client's
        # delayed ACK (~40 ms a call on Linux).
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.host, self.settings.port))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                ssl_certfile=security.tls_cert or None, ssl_keyfile=security.tls_key or None,
                                ssl_ca_certs=security.tls_ca or None,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if security.tls_mutual else ssl.CERT_NONE)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the worker owns signals
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                await self.task  # raises what stopped it
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()[:2]
        scheme = "https" if security.tls_cert else "http"
        self.base_url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
        log.info("OpenAI-compatible endpoint at %s", self.base_url)
        return self.base_url

    def open_episode(self, metadata: dict | None = None, max_calls: int | None = None,
                     sampling: types_pb2.SamplingParams | None = None) -> tuple[str, str, str]:
        """(session key, token, base URL for the OpenAI SDK) of a new episode. `sampling` (its environment's, as a
        prompt group carries it): what the episode's calls sample with where they leave a field out."""
        limits = Limits(max_sequence_tokens=self.cfg.policy.max_total_sequence_length,
                        max_calls=max_calls or self.settings.max_calls)
        defaults = None if sampling is None else with_environment(self.cfg.policy.generation, sampling)
        episode = self.sessions.open(limits, metadata, defaults)
        return episode.key, episode.token, f"{self.base_url}/sessions/{episode.key}/v1"

    def close_episode(self, key: str) -> Trajectory:
        """Refuse the episode's further calls and return its samples."""
        return self.sessions.close(key)

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task
