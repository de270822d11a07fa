"""services/common/devices.py: which GPUs each process gets, and what is refused, on many host shapes.

The expected placements are written out by hand (the rules in the module docstring), not computed. No GPU is
needed: the planner takes the host's device list as input, as it takes CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import sys

import pytest

from services.cli import main
from services.common.config import ConfigError, load_config
from services.common.devices import checked_plan, demand_of, device_env, host_gpus, plan, problems, visible_list

VLLM = ["policy.generation.backend=vllm", "trainer.device=cuda"]


def cfg_of(*overrides: str):
    return load_config(None, list(overrides))


def placed(*overrides: str, gpus: int | list[str]) -> dict[str, str]:
    gpus = [str(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    p = checked_plan(cfg_of(*overrides), gpus)
    return {name: p.visible(name) for name in p.devices}


def keys(*overrides: str, gpus: int) -> dict[str, str]:
    return dict(problems(cfg_of(*overrides), [str(i) for i in range(gpus)]))


def test_eight_gpus_split_between_four_trainer_ranks_and_four_rollout_workers():
    got = placed(*VLLM, "trainer.nproc_per_node=4", "rollout.num_workers=4", "weight_sync.backend=nccl", gpus=8)
    assert got == {"trainer": "0,1,2,3", "rollout-0": "4", "rollout-1": "5", "rollout-2": "6", "rollout-3": "7"}


def test_tensor_parallel_rollout_workers_take_consecutive_gpus_of_their_own():
    got = placed(*VLLM, "policy.generation.vllm_cfg.tensor_parallel_size=2", "trainer.nproc_per_node=4",
                 "rollout.num_workers=2", "weight_sync.backend=nccl", gpus=8)
    assert got == {"trainer": "0,1,2,3", "rollout-0": "4,5", "rollout-1": "6,7"}


def test_the_host_names_of_the_devices_are_kept():
    got = placed(*VLLM, "rollout.num_workers=2", gpus=["2", "5", "GPU-9f3a"])
    assert got == {"trainer": "2", "rollout-0": "5", "rollout-1": "GPU-9f3a"}


def test_more_rollout_workers_than_gpus_share_the_ones_after_the_trainer():
    shared = [*VLLM, "rollout.num_workers=3", "policy.generation.vllm_cfg.gpu_memory_utilization=0.3"]
    assert placed(*shared, gpus=2) == {"trainer": "0", "rollout-0": "1", "rollout-1": "1", "rollout-2": "1"}
    assert placed(*shared, "weight_sync.backend=filesystem", gpus=2)["rollout-2"] == "1"
    refused = keys(*shared, "weight_sync.backend=nccl", gpus=2)
    assert "rollout-0 and rollout-1 are both on GPU 1" in refused["weight_sync.backend"]
    assert "use gloo" in refused["weight_sync.backend"]
    crowded = keys(*VLLM, "rollout.num_workers=3", gpus=2)  # 3 x 0.6 of one GPU
    assert "3 x 0.6" in crowded["policy.generation.vllm_cfg.gpu_memory_utilization"]


def test_one_gpu_time_shares_trainer_and_rollout_with_gloo_and_refuses_nccl():
    assert placed(*VLLM, gpus=1) == {"trainer": "0", "rollout-0": "0"}  # gloo, the default
    refused = keys(*VLLM, "weight_sync.backend=nccl", gpus=1)
    assert list(refused) == ["weight_sync.backend"]
    assert "trainer and rollout-0 are both on GPU 0" in refused["weight_sync.backend"]
    assert "gloo" in refused["weight_sync.backend"] and "filesystem" in refused["weight_sync.backend"]
    full = keys(*VLLM, "policy.generation.vllm_cfg.gpu_memory_utilization=1.0", gpus=1)
    assert "GPU 0 holds trainer, rollout-0" in full["policy.generation.vllm_cfg.gpu_memory_utilization"]


def test_each_trainer_rank_and_each_tp_rank_needs_a_gpu_of_its_own():
    ranks = keys("trainer.nproc_per_node=3", "trainer.device=cuda", gpus=2)
    assert "3 ranks need a GPU each" in ranks["trainer.nproc_per_node"] and "<= 2" in ranks["trainer.nproc_per_node"]
    tp = keys(*VLLM, "policy.generation.vllm_cfg.tensor_parallel_size=4", gpus=2)
    assert "<= 2" in tp["policy.generation.vllm_cfg.tensor_parallel_size"]
    assert keys("trainer.nproc_per_node=2", "trainer.device=cuda", gpus=2) == {}


def test_a_cpu_host_leaves_every_environment_unchanged_and_refuses_nccl():
    cfg = cfg_of(*VLLM, "rollout.num_workers=2", "trainer.nproc_per_node=2")
    p = checked_plan(cfg, [])
    assert p.devices == {}
    for name in ("trainer", "rollout-0", "rollout-1", "controller", "reward_model"):
        assert device_env(p, name, {}) == {}
    nccl = dict(problems(cfg_of(*VLLM, "weight_sync.backend=nccl"), []))
    assert "this host has none" in nccl["weight_sync.backend"] and "gloo" in nccl["weight_sync.backend"]


def test_the_hf_engine_samples_on_cpu_so_its_workers_see_no_gpu():
    p = checked_plan(cfg_of("rollout.num_workers=2", "trainer.device=cuda"), ["0", "1"])
    assert p.devices == {"trainer": ("0",)}
    assert device_env(p, "rollout-1", {}) == {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert device_env(p, "controller", {}) == {}  # it never imports torch
    assert device_env(p, "trainer", {"CUDA_VISIBLE_DEVICES": "0,1"}) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_nccl_with_the_hf_engine_is_refused_by_the_config_loader_on_any_host():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["weight_sync.backend=nccl"])
    assert "config error: weight_sync.backend: nccl moves CUDA tensors" in str(err.value)
    assert "policy.generation.backend=vllm" in str(err.value)


def test_the_reward_model_server_gets_the_next_gpu():
    rm = ["environments=[{name: rm, kind: reward_model, dataset: rows.jsonl}]", "env.reward_model.model_name=tiny"]
    assert placed(*VLLM, *rm, gpus=3) == {"trainer": "0", "rollout-0": "1", "reward_model": "2"}
    assert placed(*VLLM, *rm, gpus=2) == {"trainer": "0", "rollout-0": "1", "reward_model": "1"}
    assert demand_of(cfg_of(*rm)).reward_model


@pytest.mark.parametrize("value, expected", [("0,1", ["0", "1"]), ("", []), ("-1", []), ("3, 1", ["3", "1"]),
                                             ("0,-1,2", ["0"]), ("GPU-ab,MIG-cd", ["GPU-ab", "MIG-cd"])])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, expected):
    assert visible_list(value) == expected
    assert host_gpus({"CUDA_VISIBLE_DEVICES": value}) == expected


def test_without_cuda_visible_devices_the_gpus_come_from_nvidia_smi(tmp_path):
    # A stand-in for the driver's nvidia-smi (none on this machine), printing `nvidia-smi -L`'s format.
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\nprint('GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\n"
                   f"  MIG 3g.40gb     Device  0: (UUID: MIG-2)\\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-3)')\n")
    smi.chmod(0o755)
    assert host_gpus({"PATH": str(tmp_path)}) == ["0", "1"]  # MIG lines are not GPUs of their own
    assert host_gpus({"PATH": str(tmp_path / "none")}) == []


def test_config_check_refuses_what_this_host_cannot_run_and_prints_the_placement(monkeypatch, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("environments: [{name: toy, kind: toy_copy}]\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert main(["config", "check", str(config), *VLLM, "weight_sync.backend=nccl"]) == 2
    err = capsys.readouterr().err
    assert "config error: weight_sync.backend: nccl between processes that share a device" in err
    assert "checked against this host's 1 GPU(s)" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main(["config", "check", str(config), *VLLM, "weight_sync.backend=nccl"]) == 0
    assert "trainer GPU 0; rollout-0 GPU 1" in capsys.readouterr().out


def test_a_cpu_trainer_takes_no_gpu_is_hidden_from_them_and_cannot_send_over_nccl():
    plan_ = plan(demand_of(cfg_of("policy.generation.backend=vllm", "rollout.num_workers=2")), ["0", "1"])

    assert "trainer" not in plan_.devices and plan_.visible("trainer") == ""
    assert [plan_.devices[f"rollout-{i}"] for i in range(2)] == [("0",), ("1",)]
    assert "set trainer.device=cuda" in plan_.describe()
    with pytest.raises(ConfigError, match=r"the trainer computes on CPU \(trainer.device=cpu\)"):
        load_config(None, ["policy.generation.backend=vllm", "weight_sync.backend=nccl"])
