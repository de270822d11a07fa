"""Helpers for trainer tests: a step's batch of varied lengths, and real FSDP2 ranks in processes of their own."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.config import FlywheelConfig, load_config
from services.common.infra import free_port
from services.trainer.batch import TrainBatch, batch_advantages, build_batch


def groups(n_groups: int = 4, size: int = 4, seed: int = 0) -> list[SimpleNamespace]:
    """TrajectoryGroup-shaped groups: prompts of 3-6 tokens, completions of 1-7, varied rewards."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_groups):
        prompt = torch.randint(4, 40, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        completions = []
        for _ in range(size):
            n = int(torch.randint(1, 8, (1,), generator=g))
            completions.append(SimpleNamespace(
                token_ids=torch.randint(4, 40, (n,), generator=g).tolist(), generated_mask=[True] * n,
                generation_logprobs=(-torch.rand(n, generator=g) * 3).tolist(), version_start=0,
                reward=float(torch.rand(1, generator=g) > 0.5), truncated=False, named_rewards={}, flaws=[]))
        out.append(SimpleNamespace(prompt_id=f"p{i}", env_name="toy", prompt_token_ids=prompt,
                                   completions=completions))
    return out


def step_batch(cfg: FlywheelConfig, seed: int = 0) -> tuple[TrainBatch, torch.Tensor]:
    batch = build_batch(groups(seed=seed), pad_id=0)
    advantages, _ = batch_advantages(batch, cfg.grpo)
    return batch, advantages


def config(*overrides: str) -> FlywheelConfig:
    return load_config(None, ["policy.optimizer.kwargs.lr=0.01", *overrides])


def _rank_main(rank: int, world: int, port: int, env: dict, fn, args) -> None:
    os.environ.clear()  # a fork of the forkserver has the environment the server started with: the test's, as
    os.environ.update(env)  # a spawned rank would have it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # As the trainer does (services/trainer/main.py): skip the interpreter's teardown once the group is
    # gone. There, gloo's leftover threads can abort a rank that has finished ("terminate called without
    # an active exception", seen once in CI under load), which would fail a test whose work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "services.trainer.backends.fsdp2", "trainer_harness"]
"""What the rank processes' forkserver imports once per test process: each rank then starts as a fork of it,
not as a fresh interpreter that imports torch and transformers again (about 5 s of CPU a rank on this machine)."""


def run_ranks(world: int, fn, *args) -> None:
    """fn(rank, *args) in `world` processes, forks of a forkserver that has imported PRELOAD, that form a
    gloo group (each calls init_distributed)."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(_rank_main, args=(world, free_port(), dict(os.environ), fn, args), nprocs=world, join=True,
                       start_method="forkserver")


def assert_trained_alike(a: dict, b: dict, *, atol: float, metrics: tuple[str, ...]) -> None:
    """Two runs' saved {"state": full_state_dict, "metrics": [one dict per step]} agree: the same names in the same
    order, every weight within `atol`, and each step's `metrics` within 1e-4 relative (1e-6 absolute)."""
    assert list(a["state"]) == list(b["state"])
    for name, value in b["state"].items():
        torch.testing.assert_close(a["state"][name], value, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
    for step, (mine, theirs) in enumerate(zip(a["metrics"], b["metrics"], strict=True)):
        for key in metrics:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
