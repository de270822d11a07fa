"""Find the local run a person means, so `flywheel status` and `flywheel env` need no addresses.

A run directory is one `flywheel up` made: it holds the resolved config.yaml (controller address,
admin token, TLS settings). Candidates are --run-dir, else $FLYWHEEL_RUN_DIR, else every ./runs/*/ newest first;
the first whose controller answers a health check is the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import SecurityConfig
from services.common.server import channel

PROBE_S = 1.0


class RunNotFound(LookupError):
    """No live local run: the message says where it looked and what to pass instead."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LocalRun:
    run_dir: Path
    controller: str
    """host:port of the controller's admin API."""
    token: str
    """controller.auth_token ("" when auth is off)."""
    tls: SecurityConfig | None = None
    """The run's TLS settings (security.tls_*) where its servers use TLS; None when plaintext."""


def candidates(run_dir: str | None = None, cwd: Path | None = None) -> list[Path]:
    """Run directories to try, in order."""
    if run_dir or os.environ.get("FLYWHEEL_RUN_DIR"):
        return [Path(run_dir or os.environ["FLYWHEEL_RUN_DIR"])]
    runs = [p.parent for p in (cwd or Path.cwd()).glob("runs/*/config.yaml")]
    return sorted(runs, key=lambda p: (p / "config.yaml").stat().st_mtime, reverse=True)


def read_run(run_dir: Path) -> LocalRun:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    tls = {k: v for k, v in (cfg.get("security") or {}).items() if k.startswith("tls_")}
    return LocalRun(run_dir=run_dir, controller=cfg.get("addresses", {}).get("controller", ""),
                    token=cfg.get("controller", {}).get("auth_token", "") or "",
                    tls=SecurityConfig(**tls) if tls.get("tls_ca") else None)


async def _alive(address: str, tls: SecurityConfig | None = None) -> bool:
    async with channel(address, security=tls) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=PROBE_S)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def find_local_run(run_dir: str | None = None, cwd: Path | None = None) -> LocalRun:
    tried = []
    for path in candidates(run_dir, cwd):
        if not (path / "config.yaml").is_file():
            tried.append(f"{path} (no config.yaml)")
            continue
        run = read_run(path)
        if run.controller and await _alive(run.controller, run.tls):
            return run
        tried.append(f"{path} (controller {run.controller or '?'} not answering)")
    where = "; ".join(tried) if tried else f"no runs/*/config.yaml under {cwd or Path.cwd()}"
    raise RunNotFound(f"no running flywheel found: {where}. Start one with `flywheel up`, or pass --run-dir "
                      f"(or --controller host:port)")
