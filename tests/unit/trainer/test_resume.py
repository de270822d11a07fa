"""Restoring a checkpoint continues the run exactly: the next step's loss, lr and updated weights
match an uninterrupted run on the same batches (model, optimizer, scheduler and RNG restored)."""

import pytest
import torch
from trainer_harness import config, run_ranks, step_batch

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.checkpoint import Checkpointer
from services.trainer.distributed import init_distributed
from services.trainer.main import _drop_rows_from

OVERRIDES = ["policy.train_micro_batch_size=5", "policy.train_global_batch_size=8",
             "policy.scheduler=[{name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, "
             "total_iters: 4}}]"]


def _setup(run_dir: str, extra: list[str]):
    cfg = config(f"run.run_dir={run_dir}", *OVERRIDES, *extra)
    info = init_distributed(120)
    return cfg, FSDP2Backend(cfg, info), Checkpointer(cfg, info.rank, info.world)


def _uninterrupted(rank: int, run_dir: str, out: str, extra: list[str]) -> None:
    cfg, backend, checkpointer = _setup(run_dir, extra)
    for step in range(2):
        backend.train_step(*step_batch(cfg, seed=step))
    checkpointer.save(backend, 2, {})
    metrics = backend.train_step(*step_batch(cfg, seed=2))
    _dump(rank, out, backend, metrics)


def _resumed(rank: int, run_dir: str, out: str, extra: list[str]) -> None:
    cfg, backend, checkpointer = _setup(run_dir, extra)
    latest = checkpointer.latest()
    assert latest is not None and latest.name == "step_2"
    torch.manual_seed(999)  # what restoring the RNG state must undo
    assert checkpointer.restore(backend, latest) == 2
    metrics = backend.train_step(*step_batch(cfg, seed=2))
    _dump(rank, out, backend, metrics)


def _dump(rank, out, backend, metrics) -> None:
    state = backend.full_state_dict()
    rng = torch.rand(3)  # same draw only if the RNG state came back too
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "rng": rng}, out)


@pytest.mark.parametrize("world, extra", [(1, []), (2, []), (2, ["policy.lora_cfg.enabled=true"]),
                                          (2, ["policy.optimizer.moments_dtype=bfloat16"]),
                                          (2, ["policy.tiny.architecture=qwen3_moe", "policy.expert_parallel_size=2"]),
                                          (2, ["policy.context_parallel_size=2"])],
                         ids=["1", "2", "2-lora", "2-bf16-moments", "2-expert-parallel", "2-context-parallel"])
def test_resumed_step_matches_the_uninterrupted_step(tmp_path, world, extra):
    """With LoRA the optimizer holds only the adapters, and the checkpoint both them and the frozen base. With
    bfloat16 moments the optimizer state is bfloat16 DTensor shards (services/trainer/optim.py). With expert
    parallelism the experts and their state live on a mesh of their own (expert_parallel.py); with context parallelism
the weights are sharded over every rank, not the data-parallel ones (context_parallel.py)."""
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    run_ranks(world, _uninterrupted, str(tmp_path), a, extra)
    assert not list((tmp_path / "checkpoints").glob("tmp_*"))
    run_ranks(world, _resumed, str(tmp_path), b, extra)
    first, again = torch.load(a), torch.load(b)
    assert again["metrics"]["loss"] == pytest.approx(first["metrics"]["loss"], abs=1e-6)
    assert again["metrics"]["lr"] == first["metrics"]["lr"] < 0.01  # still warming up: the schedule came back
    for name, value in first["state"].items():
        assert torch.equal(again["state"][name], value), name
    assert torch.equal(again["rng"], first["rng"])


def test_resuming_drops_the_rows_of_lost_steps_and_a_row_cut_off_mid_write(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"note": "no step"}\n{"step": 1, "loss": 0.9}\n{"step": 2, "lo')
    _drop_rows_from(path, 1)
    assert path.read_text() == '{"step": 0, "loss": 1.0}\n{"note": "no step"}\n'
