"""Stage `channel`: the weight channel between two processes on one GPU.

The trainer's tensors sit on cuda:0 (this process); a receiver process (weights_harness.py) fills tensors on
cuda:0 too, or on the CPU (an hf rollout engine left on the host). gloo (it stages CUDA tensors through host
memory), filesystem and nixl (when importable) must deliver bitwise-equal weights whose checksum the trainer
accepts. nccl cannot: NCCL refuses two ranks on one device, so the config check must refuse it with the
alternative named, and a sync tried anyway must come back within its deadline, its trainer alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpu_env import DEVICE, REPO, SLURM_NCCL_ENV, cuda_count, need_device, need_gpus, need_module, store_of

pytestmark = pytest.mark.gpu

LARGE_NUMEL = 50_000_000 if DEVICE == "cuda" else 300_000
"""One 200 MB float32 tensor beside 40 small ones of mixed dtypes on GPU (a GB/s figure worth reading); tiny
on the CPU dry run."""
TIMEOUT_S = 60.0


def _sync_two_versions(backend: str, receiver_device: str, tmp_path, figures: dict) -> None:
    import torch

    from services.common.weights import WeightSender
    from weights_harness import make_state, outcomes, spawn

    device = need_device()
    sender = WeightSender(backend=backend, bucket_bytes=16 << 20, path=str(tmp_path / "weights"))
    try:
        proc = spawn(sender.store_address, "w0", backend=backend, versions=2, large_numel=LARGE_NUMEL,
                     timeout_s=TIMEOUT_S, device=receiver_device if device == "cuda" else "cpu")
        results = []
        for version in (1, 2):  # the second reuses the epoch (and its process group)
            state = {k: v.to(device) for k, v in make_state(version, large_numel=LARGE_NUMEL).items()}
            if device == "cuda":
                torch.cuda.synchronize()
            results.append(sender.sync(version, ["w0"], state, timeout_s=TIMEOUT_S))
        got = [o for o in outcomes(proc, timeout=TIMEOUT_S) if o["event"] == "received"]
    finally:
        sender.close()
    figures.update(bytes=results[0].bytes, seconds=[round(r.seconds, 4) for r in results],
                   gbps=[round(r.gbps, 3) for r in results], epochs=[r.epoch for r in results],
                   phases=[{k: round(v, 4) for k, v in r.phases.items()} for r in results])
    assert [r.members_ok for r in results] == [["w0"], ["w0"]], [r.members_dropped for r in results]
    assert [(o["version"], o["equal"]) for o in got] == [(1, True), (2, True)]
    assert [o["checksum"] for o in got] == [r.checksum for r in results]


@pytest.mark.parametrize("receiver_device", ["cuda:0", "cpu"])
def test_gloo_moves_gpu_weights_to_a_second_process_bitwise(receiver_device, tmp_path, figures):
    _sync_two_versions("gloo", receiver_device, tmp_path, figures)


def test_filesystem_moves_gpu_weights_to_a_second_process_on_the_same_gpu(tmp_path, figures):
    _sync_two_versions("filesystem", "cuda:0", tmp_path, figures)


def test_nixl_moves_gpu_weights_to_a_second_process_on_the_same_gpu(tmp_path, figures):
    need_module("nixl", "its CUDA wheels (nixl-cu12, nixl-cu13, over 100 MB installed each) do not fit the "
                        "check's 64 MiB carry of wheels; run this where nixl is installed")
    _sync_two_versions("nixl", "cuda:0", tmp_path, figures)


def test_config_check_refuses_nccl_between_processes_on_one_gpu(tmp_path, figures):
    """DESIGN.md, Devices: a combination that cannot work is refused when the config is checked, with the
    alternative named. One GPU, the trainer on it and one vLLM worker, nccl: refused because they would share the
    device. The vLLM engine and trainer.device=cuda are named so that the refusal is the device rule's, not
    nccl-with-the-hf-engine's or nccl-with-a-CPU-trainer's (the first two GPU runs passed on the latter, the
    wrong reason); checking the config imports no vLLM. On the CPU dry run CUDA_VISIBLE_DEVICES=0 stands for the
    one GPU, so the same rule is checked there."""
    if need_device() == "cuda" and cuda_count() > 1:
        pytest.skip("more than one GPU here: nccl between processes can work")
    # A file, not an override: `config check` reads its first argument as the config file.
    config = tmp_path / "nccl.yaml"
    config.write_text("environments: [{name: toy, kind: toy_copy}]\nweight_sync: {backend: nccl}\n"
                      "trainer: {device: cuda}\npolicy: {generation: {backend: vllm}}\n")
    env = os.environ if need_device() == "cuda" else {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "config", "check", str(config)],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    figures.update(exit_code=out.returncode, message=(out.stdout + out.stderr).strip()[-600:])
    assert out.returncode != 0, f"config check accepted nccl with one GPU:\n{out.stdout}"
    text = (out.stdout + out.stderr).lower()
    assert "share a device" in text and "gloo" in text, text[-600:]


def test_nccl_sync_on_one_gpu_fails_within_its_deadline_and_the_trainer_lives(figures):
    """Tried anyway (the config check bypassed): both ranks on cuda:0. The trainer runs in its own process
    (nccl_sender.py), since torch's NCCL watchdog may end the process that holds a failed communicator."""
    from weights_harness import outcomes, spawn

    need_gpus(1)
    deadline_s = 10.0
    argv = [sys.executable, str(REPO / "tests" / "gpu" / "nccl_sender.py"), "--device", "cuda:0",
            "--timeout", str(deadline_s)]
    sender = subprocess.Popen(argv, env=SLURM_NCCL_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    receiver = spawn(store_of(sender), "w0", backend="nccl", device="cuda:0", timeout_s=deadline_s + 10)
    start = time.monotonic()
    out, err = sender.communicate("go\n", timeout=deadline_s + 60)
    figures["sender_seconds"] = round(time.monotonic() - start, 2)
    result = json.loads(out.splitlines()[-1]) if out.strip() else {}
    try:  # the rollout side may die of it too: reported, but this check is about the trainer
        receiver_lines = outcomes(receiver, timeout=deadline_s + 30)
    except AssertionError as died:
        receiver_lines = [{"event": "died", "error": str(died)[-600:]}]
    figures.update(result=result, receiver=receiver_lines[-3:], sender_stderr=err[-800:])
    assert sender.returncode == 0, f"the trainer process died (code {sender.returncode}):\n{err[-2000:]}"
    assert result["members_ok"] == [] and result["members_dropped"] == ["w0"], result
    assert result["seconds"] < deadline_s + 5, result
    assert not any(o["event"] == "received" for o in receiver_lines)
