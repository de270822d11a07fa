"""The trainer's ranks: where they come from, how they meet, and how they stay in lockstep.

Three ways to get N ranks, one code path once they exist:
- `flywheel serve trainer --nproc-per-node N` (trainer.nproc_per_node): this process becomes a
  launcher that starts N rank processes on this node, torchrun-style, and watches them;
- under torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are set;
- under srun: SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, plus MASTER_ADDR and
  MASTER_PORT, which the batch script exports (the first node of the trainer's group).

Where the ranks compute comes from the config (`trainer_device`), never from whether this host happens
to have a GPU: the same config runs the same way everywhere, and the CPU test suite stays on CPU on a GPU
machine. On cuda, local rank r takes the r-th GPU this process sees (the launchers set CUDA_VISIBLE_DEVICES).

Only rank 0 talks to the network (replay, NATS, gRPC, the weight channel). The other ranks
run `Lockstep.follow`: rank 0 broadcasts the name and arguments of every collective
operation (a training step with its batch, gathering weights, saving a checkpoint) before it
runs it, so all ranks enter the same collectives in the same order and none can deadlock.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.config import FlywheelConfig, dump_config
from services.common.infra import child_env, dying_with_parent, free_port

log = logging.getLogger("flywheel.trainer")
FOLLOWER_GRACE_S = 2.0
STOP_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int
    device: str = "cpu"
    """torch device this rank computes on: "cpu" or "cuda:<local rank>"."""


def rank_from_env(env: dict[str, str] | None = None) -> RankInfo | None:
    """This process's rank under torchrun, our launcher or srun; None when started alone."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return RankInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")))
    return None


def trainer_device(cfg: FlywheelConfig) -> str:
    """"cpu" or "cuda": trainer.device, except that Megatron-Core runs on cuda only."""
    return "cuda" if cfg.policy.megatron_cfg.enabled else cfg.trainer.device


def process_group_backend(device: str) -> str:
    """The default group's backend. On cuda, NCCL for device tensors and gloo beside it for host ones, as
    torchtitan does: FSDP2's cpu_offload keeps shards and gradients on the host, so clipping all-reduces their
    norms there, which an NCCL-only group refuses. On cpu, gloo."""
    return "cuda:nccl,cpu:gloo" if device == "cuda" else "gloo"


def init_distributed(timeout_s: float, device: str = "cpu") -> RankInfo:
    """Join (or make) the default process group for ranks on `device` ("cpu" or "cuda", see `trainer_device`)."""
    info = rank_from_env() or RankInfo(0, 1, 0)
    if device == "cuda":
        info = replace(info, device=_claim_gpu(info.local_rank))
    if dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), info.local_rank, info.device)
    backend = process_group_backend(device)
    timeout = timedelta(seconds=timeout_s)
    if info.world == 1:  # explicit address: a child process must not inherit a rendezvous
        init = f"tcp://127.0.0.1:{free_port()}"
    else:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(f"{info.world} ranks need {key} in the environment (srun: export it)")
        init = "env://"
    dist.init_process_group(backend, init_method=init, rank=info.rank, world_size=info.world, timeout=timeout)
    return info


def _claim_gpu(local_rank: int) -> str:
    """Make the local rank's own GPU current; refuse to share one (NCCL refuses two ranks on one device)."""
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= seen:
        raise RuntimeError(f"the trainer runs on cuda (trainer.device, or Megatron-Core) and local rank {local_rank} "
                           f"needs its own GPU, but this process sees {seen} (CUDA_VISIBLE_DEVICES); give each rank "
                           "a GPU, or set trainer.device=cpu")
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


class Lockstep:
    """Rank 0 calls `call(name, *args)`; every rank runs `target.name(*args)` in the same order."""

    def __init__(self, target, rank: int, world: int) -> None:
        self.target = target
        self.rank = rank
        self.world = world
        self.idle = threading.Event()
        """Clear while rank 0 is inside a call (a stop message then would interleave with it)."""
        self.idle.set()

    def call(self, name: str, *args):
        assert self.rank == 0, "only rank 0 leads"
        self.idle.clear()
        try:
            self._broadcast((name, args))
            return getattr(self.target, name)(*args)
        finally:
            self.idle.set()

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 runs until it says stop."""
        while True:
            name, args = self._broadcast(None)
            if name is None:
                return
            getattr(self.target, name)(*args)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Tell the followers to return, once rank 0's call in flight (a step a stop signal
        interrupted) has finished; if it does not finish in time, the launcher ends them."""
        if self.idle.wait(wait_s):
            self._broadcast((None, ()))

    def _broadcast(self, message):
        if self.world == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def launch_ranks(cfg: FlywheelConfig, nproc: int) -> int:
    """Start `nproc` trainer ranks on this node and wait for them; returns the exit code.

    SIGTERM/SIGINT go to rank 0 only: it stops the others through Lockstep. A rank that
    fails ends the whole group, as torchrun does.
    """
    run_dir = Path(cfg.run.run_dir or ".")
    config = run_dir / "trainer-ranks.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(dump_config(cfg))
    base = child_env() | {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    argv = dying_with_parent([sys.executable, "-m", "services.cli", "serve", "trainer", "--config", str(config)])
    procs = [subprocess.Popen(argv, env=base | {"RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: procs[0].send_signal(signum))
    return _watch(procs)


def _watch(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None or codes[0] is not None:
            break
        time.sleep(0.2)
    deadline = time.monotonic() + (FOLLOWER_GRACE_S if failed is None else 0.0)
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank pid %d did not stop; killing it", p.pid)
            p.kill()
            p.wait()
    return failed if failed is not None else procs[0].returncode
