"""Manifest, bucket plan, packing and checksum: pure layout logic, CPU, no processes."""

from __future__ import annotations

import pytest
import torch

from services.common.weights.manifest import (
    ALIGN,
    SAMPLE_BYTES,
    Checksum,
    Manifest,
    checksum,
    plan_buckets,
    plan_order,
    sample,
)
from services.common.weights.packing import new_buffer, pack, unpack, whole_source


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "big": torch.randn(4096, generator=g),
        "c": torch.randint(0, 100, (2, 2), generator=g),
        "scalar": torch.tensor(3.5),
    }


def test_digest_is_stable_and_sensitive_to_name_shape_dtype_and_order():
    base = Manifest.of(_state())
    assert base.digest == Manifest.of(_state(seed=1)).digest  # values do not matter
    renamed = dict(_state())
    renamed["a2"] = renamed.pop("a")
    reordered = dict(reversed(list(_state().items())))
    retyped = {**_state(), "a": torch.zeros(3, 5, dtype=torch.float16)}
    reshaped = {**_state(), "a": torch.zeros(5, 3)}
    digests = {Manifest.of(s).digest for s in (renamed, reordered, retyped, reshaped)}
    assert base.digest not in digests and len(digests) == 4


def test_plan_sends_tensors_larger_than_a_bucket_whole_and_packs_the_rest():
    plan = plan_buckets(Manifest.of(_state()), bucket_bytes=256)
    whole = [b for b in plan if b.whole]
    assert [b.slots[0].spec.name for b in whole] == ["big"]
    assert all(b.nbytes <= 256 for b in plan if not b.whole)
    assert sorted(plan_order(plan)) == sorted(_state())  # every tensor exactly once
    assert all(s.offset % ALIGN == 0 for b in plan for s in b.slots)


def test_small_tensors_fill_one_bucket_across_the_whole_ones_between_them():
    kib = 1024 // 4  # float32 elements per KiB
    state = {"a": torch.zeros(kib), "b": torch.zeros(2 * kib), "D": torch.zeros(64 * kib),
             "c": torch.zeros(kib), "e": torch.zeros(3 * kib)}
    plan = plan_buckets(Manifest.of(state), bucket_bytes=4096, whole_bytes=8192)
    assert [[s.spec.name for s in b.slots] for b in plan] == [["D"], ["a", "b", "c"], ["e"]]
    assert [b.whole for b in plan] == [True, False, False]


@pytest.mark.parametrize("bucket_bytes", [64, 128, 1000, 1 << 20])
def test_plan_is_identical_when_derived_twice(bucket_bytes):
    # Values differ, layout does not: the plan depends on the manifest only.
    a, b = Manifest.of(_state()), Manifest.of(_state(9))
    assert plan_buckets(a, bucket_bytes) == plan_buckets(b, bucket_bytes)


@pytest.mark.parametrize("bucket_bytes", [64, 200, 4096, 1 << 20])
def test_pack_then_unpack_is_bitwise_identity(bucket_bytes):
    src, dst = _state(1), {k: torch.zeros_like(v) for k, v in _state(1).items()}
    for bucket in plan_buckets(Manifest.of(src), bucket_bytes):
        if bucket.whole:
            dst[bucket.slots[0].spec.name].view(-1).view(torch.uint8).copy_(whole_source(bucket, src))
        else:
            unpack(bucket, pack(bucket, src, new_buffer(bucket.nbytes)).clone(), dst)
    assert all(torch.equal(src[k], dst[k]) for k in src)


def test_pack_accepts_non_contiguous_sources():
    src = {"t": torch.arange(12.0).reshape(3, 4).t()}
    (bucket,) = plan_buckets(Manifest.of(src), 1024)
    dst = {"t": torch.zeros(4, 3)}
    unpack(bucket, pack(bucket, src, new_buffer(bucket.nbytes)), dst)
    assert torch.equal(dst["t"], src["t"])


def test_unpack_fills_parameters_and_non_contiguous_destinations():
    src = {"w": torch.randn(3, 4), "t": torch.randn(4, 3), "h": torch.randn(5).to(torch.float16)}
    dst = {"w": torch.nn.Parameter(torch.zeros(3, 4)), "t": torch.zeros(3, 4).t(), "h": torch.zeros(5, dtype=torch.float16)}
    (bucket,) = plan_buckets(Manifest.of(src), 1024)
    unpack(bucket, pack(bucket, src, new_buffer(bucket.nbytes)), dst)
    assert all(torch.equal(dst[k], src[k]) for k in src)


def test_whole_source_shares_storage_with_a_contiguous_tensor():
    src = {"big": torch.randn(100)}
    (bucket,) = plan_buckets(Manifest.of(src), 64)
    assert bucket.whole and whole_source(bucket, src).data_ptr() == src["big"].data_ptr()


def test_checksum_changes_with_one_bit_and_with_order():
    s = _state()
    base = checksum(s.values())
    assert base == checksum(_state().values())
    flipped = {k: v.clone() for k, v in s.items()}
    flipped["big"].view(torch.int32)[17] ^= 1
    assert checksum(flipped.values()) != base
    assert checksum(reversed(list(s.values()))) != base


def test_checksum_reads_small_tensors_whole_and_large_ones_at_their_ends_and_samples():
    small = torch.zeros(SAMPLE_BYTES, dtype=torch.uint8)
    large = torch.zeros(64 * SAMPLE_BYTES, dtype=torch.uint8)
    base_small, base_large = checksum([small]), checksum([large])
    for i in (0, 12345, SAMPLE_BYTES - 1):  # any byte of a tensor up to SAMPLE_BYTES
        t = small.clone()
        t[i] = 1
        assert checksum([t]) != base_small
    for i in (0, large.numel() - 1):  # truncation or a shifted copy shows at either end
        t = large.clone()
        t[i] = 1
        assert checksum([t]) != base_large
    assert sample(large).numel() == SAMPLE_BYTES


def test_checksum_folded_piece_by_piece_equals_the_whole():
    s = {**_state(), "huge": torch.randn(SAMPLE_BYTES)}
    folded = Checksum()
    for t in s.values():
        folded.update([t])
    assert folded.hexdigest() == checksum(s.values())


def test_the_hosts_in_place_blocks_hash_as_the_devices_gathered_sample():
    """On the host the checksum hashes each sampled block in place; a device gathers them with `sample` first.
    Both must give one digest, or a CPU receiver would nack a GPU trainer's version."""
    import xxhash

    s = {**_state(), "huge": torch.randn(SAMPLE_BYTES), "strided": torch.randn(512, 300).t()}
    gathered = xxhash.xxh3_64()
    for t in s.values():
        gathered.update(sample(t).numpy())
    assert checksum(s.values()) == gathered.hexdigest()


@pytest.mark.gpu
def test_checksum_is_the_same_on_cuda_and_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    s = {**_state(), "huge": torch.randn(SAMPLE_BYTES)}
    assert checksum(t.cuda() for t in s.values()) == checksum(s.values())


def test_plan_rejects_buckets_smaller_than_the_alignment():
    with pytest.raises(ValueError):
        plan_buckets(Manifest.of(_state()), ALIGN - 1)
