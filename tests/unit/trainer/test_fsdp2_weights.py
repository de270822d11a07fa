"""FSDP2's weights for the sync: cast before the gather, kept only on the rank that sends them.

The oracle is the path the trainer used before: torch's `get_model_state_dict(full_state_dict=True)` in fp32,
LoRA merged, then cast (`_old_path`). The peak is the CPU allocator's own count of live bytes while each
path runs on rank 0 (torch.profiler with profile_memory: every allocation and free, in order).
"""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.profiler import ProfilerActivity, profile
from trainer_harness import config, run_ranks, step_batch

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed
from services.trainer.lora import merge_lora


def _old_path(backend: FSDP2Backend) -> dict[str, torch.Tensor]:
    """FSDP2Backend.full_state_dict before this change, as it ran on CPU (on GPU cpu_offload was False, and every
    rank got the whole fp32 dict)."""
    state = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if backend.lora:
        state = merge_lora(state, backend.lora.scale)
    return {k: v.to(backend.publish_dtype) for k, v in state.items()}


def _peak_bytes(fn):
    """(fn(), the most bytes the CPU allocator held at once for this thread while fn ran, above its start)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak


def _both_paths(rank: int, out: str, overrides: list[str]) -> None:
    cfg = config("policy.precision=bfloat16", *overrides)
    backend = FSDP2Backend(cfg, init_distributed(120))
    backend.train_step(*step_batch(cfg))  # trained weights: not the seed's, and LoRA's B no longer zero
    old, old_peak = _peak_bytes(lambda: _old_path(backend))
    new, new_peak = _peak_bytes(backend.full_state_dict)
    torch.save({"old": old, "new": new, "old_peak": old_peak, "new_peak": new_peak}, f"{out}.{rank}")


@pytest.mark.parametrize("extra", [[], ["policy.cpu_offload=true"], ["policy.tensor_parallel_size=2"],
                                   ["policy.lora_cfg.enabled=true"]], ids=["plain", "cpu_offload", "tp2", "lora"])
def test_synced_weights_equal_the_old_paths_with_a_lower_peak_and_only_on_the_sending_rank(tmp_path, extra):
    out = str(tmp_path / "weights")
    run_ranks(2, _both_paths, out, extra)
    first, second = (torch.load(f"{out}.{r}") for r in (0, 1))
    old, new = first["old"], first["new"]
    assert list(new) == list(old)  # the manifest's order too
    for name, value in old.items():
        assert new[name].dtype == torch.bfloat16 and new[name].device.type == "cpu"
        assert torch.equal(new[name].view(torch.int16), value.view(torch.int16)), name
    assert second["new"] == {}
    # The old path held the whole model in fp32 and its bf16 copy at once (at least 3x the bf16 bytes); the new
    # one the bf16 dict and a tensor or two in flight (LoRA: one adapted layer's three in fp32). Frees on gloo's
    # own threads are not seen here, so both figures are upper bounds; the new one is lower by more than the
    # whole bf16 model.
    whole = sum(t.nbytes for t in new.values())
    print(f"whole bf16 {whole} B; rank-0 peak old {first['old_peak']} B, new {first['new_peak']} B")
    assert first["old_peak"] >= 3 * whole
    assert first["new_peak"] <= first["old_peak"] - whole
