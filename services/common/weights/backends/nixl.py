"""nixl: receivers READ the trainer's registered buckets one-sided over UCX, at their own pace.

Per round, sender:   pack every packed bucket into one arena; register the arena and each whole tensor with
                     the trainer's nixl agent; publish the agent metadata and one (addr, len, dev) descriptor
                     per bucket under `epoch/{e}/v{version}/nixl/...`; keep the memory registered until
                     `release`.
Per round, receiver: wait for those keys (deadline); register its destinations (its own arena, and whole
                     tensors in place); one READ transfer of all buckets; poll its state until DONE, ERR or
                     the deadline; unpack.

Descriptors travel as JSON, not nixl's pickled lists, so the store never carries pickles.
Packing all buckets before publishing costs one copy of the small tensors and no double buffering; the
one-sided read is what this backend buys (receivers pull at their own pace; while they do, the trainer only
progresses its UCX worker, in `wait`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.weights.backends import Backend, Epoch, OnBucket
from services.common.weights.manifest import ALIGN, Bucket
from services.common.weights.packing import new_buffer, pack, unpack, whole_destination, whole_source
from services.common.weights.rendezvous import Deadline, wait_key

POLL_S = 0.001
PROGRESS_S = 0.0001  # the trainer's progress cadence while receivers read


@dataclass(kw_only=True, slots=True)
class _Region:
    bucket: Bucket
    tensor: torch.Tensor
    """Flat uint8 memory holding this bucket on this side."""
    copy_back: bool = False
    """Receiver: unpack from `tensor` into the destinations after the read."""


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def _desc(t: torch.Tensor) -> tuple[int, int, int]:
    return (t.data_ptr(), t.numel() * t.element_size(), max(0, t.get_device()))


class NixlBackend(Backend):
    name = "nixl"
    # One READ carries every descriptor, and an extra descriptor costs next to nothing, so only tiny tensors
    # (norms, biases) are worth packing (benchmarks/weight_sync.py: whole from 64 KiB beat 1 MiB).
    whole_bytes = 64 << 10

    def __init__(self):
        self._agent = None
        self.arena: torch.Tensor | None = None
        self._registered: dict[int, object] = {}  # epoch -> registration descriptor list (sender)

    def _make_agent(self):
        # No UCX progress thread on either side: NIXL's spins with no delay and holds a whole core for the life
        # of the process (measured here: 1.0 CPU-second per idle second). Receivers progress by polling their
        # transfer; the trainer progresses in `wait`, while receivers read.
        from nixl._api import nixl_agent, nixl_agent_config

        if self._agent is None:
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = nixl_agent(f"flywheel-{uuid.uuid4().hex[:12]}", config)
        return self._agent

    @property
    def agent(self):
        if self._agent is None:
            raise RuntimeError("nixl agent not started")
        return self._agent

    def _arena(self, plan: list[Bucket], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """One staging buffer for every packed bucket, reused across epochs; returns it and bucket offsets."""
        offsets, total = [], 0
        for b in plan:
            total = (total + ALIGN - 1) // ALIGN * ALIGN  # typed views of each bucket stay aligned
            offsets.append(total)
            total += 0 if b.whole else b.nbytes
        if self.arena is None or self.arena.numel() < total or self.arena.device != device:
            self.arena = new_buffer(max(total, 1), device)
        return self.arena, offsets

    def _regions(self, ep: Epoch, tensors, *, sender: bool) -> list[_Region]:
        device = next(iter(tensors.values())).device
        arena, offsets = self._arena(ep.plan, device)
        regions = []
        for b, off in zip(ep.plan, offsets, strict=True):
            if b.whole and sender:
                regions.append(_Region(bucket=b, tensor=whole_source(b, tensors)))
            elif b.whole:
                flat, copy_back = whole_destination(b, tensors)
                regions.append(_Region(bucket=b, tensor=flat, copy_back=copy_back))
            else:
                regions.append(_Region(bucket=b, tensor=arena[off : off + b.nbytes], copy_back=not sender))
        return regions

    def _register(self, regions: list[_Region]):
        # The arena is registered once as a whole; registering each slice would overlap.
        seen, tensors = set(), []
        for r in regions:
            base = self.arena if (not r.bucket.whole and self.arena is not None) else r.tensor
            if base.data_ptr() not in seen:
                seen.add(base.data_ptr())
                tensors.append(base)
        return self.agent.register_memory(tensors)

    # -- sender --------------------------------------------------------------------------------------------

    def send(self, ep: Epoch, tensors: Mapping[str, torch.Tensor], deadline: Deadline) -> None:
        self._make_agent()
        regions = self._regions(ep, tensors, sender=True)
        for r in regions:
            if not r.bucket.whole:
                pack(r.bucket, tensors, r.tensor)
        self._registered[ep.epoch] = self._register(regions)
        ep.store.set("nixl/agent", self.agent.get_agent_metadata())
        descs = {"mem_type": _mem_type(regions[0].tensor), "descs": [_desc(r.tensor) for r in regions]}
        ep.store.set("nixl/descs", json.dumps(descs))

    def wait(self, seconds: float) -> None:
        # The target of a READ must make progress too: over TCP UCX serves the data through its worker, and on
        # every transport the completion handshake needs it (a READ stays in PROC otherwise, data landed or not).
        if self._agent is None:  # send failed before it started the agent: nobody is reading
            time.sleep(seconds)
            return
        end = time.monotonic() + seconds
        while True:
            self._agent.get_new_notifs()
            if time.monotonic() >= end:
                return
            time.sleep(PROGRESS_S)

    def release(self, ep: Epoch) -> None:
        reg = self._registered.pop(ep.epoch, None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    # -- receiver ------------------------------------------------------------------------------------------

    def receive(
        self, ep: Epoch, into: Mapping[str, torch.Tensor], deadline: Deadline, on_bucket: OnBucket = None
    ) -> None:
        self._make_agent()
        meta = wait_key(ep.store, "nixl/agent", deadline, "the trainer's nixl agent metadata")
        remote = json.loads(wait_key(ep.store, "nixl/descs", deadline, "the trainer's nixl descriptors"))
        peer = self.agent.add_remote_agent(meta)
        regions = self._regions(ep, into, sender=False)
        reg = self._register(regions)
        handle = None
        try:
            mine = [_desc(r.tensor) for r in regions]
            local = self.agent.get_xfer_descs(mine, _mem_type(regions[0].tensor))
            theirs = self.agent.get_xfer_descs([tuple(d) for d in remote["descs"]], remote["mem_type"])
            handle = self.agent.initialize_xfer("READ", local, theirs, peer)
            state = self.agent.transfer(handle)
            while state == "PROC" and not deadline.expired:
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TimeoutError(f"nixl READ {'failed' if state == 'ERR' else 'timed out'} (state {state})")
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - an active transfer may refuse release; nothing to do
                    pass
            self.agent.deregister_memory(reg)
            self.agent.remove_remote_agent(peer)
        for r in regions:
            if r.copy_back:
                unpack(r.bucket, r.tensor, into)
            if on_bucket is not None:
                on_bucket(r.bucket)
