"""Where the trainer computes comes from the config, never from whether the host has a GPU.

So the CPU suite stays on CPU on a GPU machine: its 2-rank tests used to switch to NCCL there and put both
ranks on cuda:0, which NCCL refuses. The host with GPUs is simulated by making torch report one.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig
from trainer_harness import config, run_ranks

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import _claim_gpu, init_distributed, process_group_backend, trainer_device


def _on_a_gpu_host(rank: int, out: str) -> None:
    real = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)  # one GPU for two ranks
    cfg = config()
    try:
        info = init_distributed(120, trainer_device(cfg))
    finally:  # this CPU build of torch cannot go further as a GPU host (the model's RNG fork would touch CUDA)
        torch.cuda.is_available, torch.cuda.device_count = real
    backend = FSDP2Backend(cfg, info)
    torch.save({"backend": dist.get_backend(), "device": str(backend.device)}, f"{out}.{rank}")


def test_a_host_with_a_gpu_keeps_the_default_config_on_cpu_with_gloo(tmp_path):
    out = str(tmp_path / "ranks")
    run_ranks(2, _on_a_gpu_host, out)
    assert [torch.load(f"{out}.{r}") for r in (0, 1)] == [{"backend": "gloo", "device": "cpu"}] * 2


def test_the_trainer_device_is_the_configs_and_megatron_runs_on_cuda():
    assert trainer_device(config()) == "cpu"
    assert trainer_device(config("trainer.device=cuda")) == "cuda"
    assert trainer_device(config("policy.megatron_cfg.enabled=true")) == "cuda"


def test_on_cuda_host_tensors_go_over_gloo_beside_nccl():
    # FSDP2's cpu_offload all-reduces host tensors (gradient norms) over the default group: torch's own parser
    # of the backend string says which backend each device's tensors take.
    assert BackendConfig(Backend(process_group_backend("cuda"))).get_device_backend_map() == {
        "cuda": "nccl", "cpu": "gloo"}
    assert BackendConfig(Backend(process_group_backend("cpu"))).get_device_backend_map()["cpu"] == "gloo"


def test_cuda_refuses_a_rank_without_a_gpu_of_its_own():
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(RuntimeError, match="needs its own GPU"):
        _claim_gpu(seen)  # local ranks 0 .. seen - 1 have one each; this one would share
