"""filesystem: one safetensors file per version in a shared directory, for clusters without a fabric.

The sender writes `<path>/v{version}.safetensors.tmp-<epoch>` and renames it into place (rename is atomic on
one filesystem, so a reader never sees a half-written file), then names the file under `epoch/{e}/fs/file`.
Receivers load it with `safe_open` and copy into their tensors. The manifest digest is stored in the file's
metadata and checked on load. The newest `KEEP` versions are kept; older files are deleted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.weights.backends import Backend, Epoch, OnBucket
from services.common.weights.manifest import Manifest
from services.common.weights.rendezvous import Deadline, wait_key

KEEP = 2
_NAME = re.compile(r"^v(\d+)\.safetensors$")


class FilesystemBackend(Backend):
    name = "filesystem"

    def send(self, ep: Epoch, tensors: Mapping[str, torch.Tensor], deadline: Deadline) -> None:
        if not ep.path:
            raise ValueError("filesystem weight backend needs a shared directory (WeightSender(path=...))")
        folder = Path(ep.path)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"v{ep.version}.safetensors"
        tmp = folder / f".v{ep.version}.safetensors.tmp-{ep.epoch}"
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = {"manifest_digest": Manifest.of(tensors).digest, "version": str(ep.version)}
        save_file(cpu, str(tmp), metadata=meta)
        os.replace(tmp, final)
        ep.store.set("fs/file", final.name)
        _prune(folder, keep=KEEP)

    def receive(
        self, ep: Epoch, into: Mapping[str, torch.Tensor], deadline: Deadline, on_bucket: OnBucket = None
    ) -> None:
        name = wait_key(ep.store, "fs/file", deadline, "the weights file name").decode()
        with safe_open(str(Path(ep.path) / name), framework="pt") as f:
            digest = (f.metadata() or {}).get("manifest_digest")
            if digest != Manifest.of(into).digest:
                raise ValueError(f"{name}: manifest digest {digest} does not match the receiver's model")
            for bucket in ep.plan:
                for slot in bucket.slots:
                    into[slot.spec.name].copy_(f.get_tensor(slot.spec.name))
                if on_bucket is not None:
                    on_bucket(bucket)


def _prune(folder: Path, *, keep: int) -> None:
    versions = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)))
    for _, p in versions[:-keep]:
        p.unlink(missing_ok=True)
