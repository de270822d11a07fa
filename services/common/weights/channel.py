"""The weight channel: `WeightSender` on the trainer, `WeightReceiver` on each rollout worker.

One sync = one version pushed to a list of members, in one or more epochs (attempts):

    trainer (rank 0)                                  receiver (rank i + 1)
    pick epoch e (see below); write epoch/{e}/v{version}/meta
    announce(version, epoch, digest, members) ──────▶ digest matches? else ManifestMismatch
                                              ◀────── joined/{id}
    all joined? go=start  (else go=abandon,  ──────▶ (abandon: EpochAbandoned, wait for the next epoch)
                           retry with the joined)
    backend.send(buckets)  ═══════ bytes ═══════════▶ backend.receive(into)
                                              ◀────── ack/{version}/{id} = checksum   (nack on error)
    acked: ok;  nacked: retried in a new epoch;  silent at the attempt's deadline: dropped

Epochs: a new epoch (and, for gloo/nccl, a new process group) starts whenever the members differ from the last
fully confirmed round, after any failure, or for a repeat of the same version; otherwise the next version
reuses the epoch and its group. Per-version keys live under `epoch/{e}/v{version}/`.

Deadlines: the sync's deadline bounds everything. Each attempt but the last gets half of the time left (so a
stalled member cannot eat the retry), and each epoch's collectives time out with it, on the host: for nccl the
group's own timeout (its watchdog's) comes a margin later and the group is aborted first (backends/collective.py).
A dropped member is not waited for again in this sync; the caller puts it back in `members` at a later sync
to rejoin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.weights import metrics
from services.common.weights.backends import Backend, Epoch, make_backend
from services.common.weights.manifest import Bucket, Checksum, Manifest, checksum, plan_buckets, plan_order
from services.common.weights.rendezvous import (
    ABORT_KEY,
    Announcement,
    Deadline,
    connect_store,
    epoch_store,
    get_json,
    host_store,
    local_ip_towards,
    poll_intervals,
    publish_to_store,
    put_json,
    round_store,
    split_address,
    wait_key,
    wait_keys,
)

DEFAULT_BUCKET_BYTES = 64 << 20
log = logging.getLogger(__name__)


class ManifestMismatch(ValueError):
    """The receiver's model does not match the announced manifest (names, shapes, dtypes or order)."""


class EpochAbandoned(RuntimeError):
    """The sender gave up on this epoch before sending data (a member did not join); wait for the next one."""


class TransferFailed(RuntimeError):
    """The epoch's transfer failed on this receiver; the sender retries it in a new epoch if time allows."""


@dataclass(kw_only=True, slots=True)
class SyncResult:
    version: int
    """Policy version pushed."""
    epoch: int
    """Last epoch used by this sync."""
    members_ok: list[str]
    """Members that confirmed the version with the right checksum."""
    members_dropped: list[str]
    """Members that did not confirm before the deadline; they rejoin at a later sync."""
    seconds: float
    """Wall time of the whole sync, all attempts."""
    bytes: int
    """Payload bytes per member."""
    checksum: str
    """Checksum of the sender's tensors (see `manifest.checksum`); "" if not finished by the deadline."""
    manifest_digest: str
    """sha256 of the manifest."""
    attempts: int = 1
    """Epochs used."""
    failures: int = 0
    """Attempts that did not confirm every member."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, summed over attempts: announce (meta, store and NATS announcement), join (waiting
    for every member to join), send (the backend's transfer), confirm (waiting for the checksums)."""

    @property
    def gbps(self) -> float:
        """Payload GB/s per member (1 GB = 1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(kw_only=True, slots=True)
class _Outcome:
    acked: list[str] = field(default_factory=list)
    retry: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


class WeightSender:
    """Trainer side. Hosts the rendezvous TCPStore and pushes versions to members."""

    def __init__(
        self,
        *,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        whole_bytes: int | None = None,
        path: str = "",
        publish: Callable[[Announcement], None] | None = None,
        join_timeout_s: float = 10.0,
        max_attempts: int = 3,
    ):
        """`host`: the trainer's address as receivers reach it (store and gloo/nccl connections).
        `publish(announcement)`: called on the thread running `sync` once per round, before the sender waits
        for joins; wire NATS here (hand off, do not block). The announcement is also always written to the
        store under `announce/latest`. `path`: shared directory of the filesystem backend.
        `bucket_bytes`/`whole_bytes`: see `plan_buckets`; `whole_bytes` defaults to the backend's
        (`Backend.whole_bytes`). `join_timeout_s`: how long a round waits for members
        to join before going on without the absent ones. `max_attempts`: rounds per sync at most."""
        self.backend: Backend = make_backend(backend)
        self.host = host
        self.store = host_store(host, port)
        self.bucket_bytes = bucket_bytes
        self.whole_bytes = self.backend.whole_bytes if whole_bytes is None else whole_bytes
        self.path = path
        self.publish = publish
        self.join_timeout_s = join_timeout_s
        self.max_attempts = max_attempts
        self.epoch = 0
        self._live: tuple[int, tuple[str, ...], int] | None = None  # (epoch, members, version) last confirmed
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-checksum")

    @property
    def store_address(self) -> str:
        """host:port of the rendezvous store, for the announcement."""
        return f"{self.host}:{self.store.port}"

    def announcement(
        self, version: int, epoch: int, members: list[str], manifest_digest: str
    ) -> Announcement:
        """Fields of the `WeightAnnouncement` for one epoch."""
        return Announcement(
            version=version,
            epoch=epoch,
            manifest_digest=manifest_digest,
            store_address=self.store_address,
            backend=self.backend.name,
            members=list(members),
            path=self.path,
        )

    def sync(
        self, version: int, members: list[str], tensors: Mapping[str, torch.Tensor], *, timeout_s: float
    ) -> SyncResult:
        """Push `tensors` as `version` to `members`; never blocks beyond `timeout_s`."""
        start, deadline = time.monotonic(), Deadline(timeout_s)
        manifest = Manifest.of(tensors)
        plan = plan_buckets(manifest, self.bucket_bytes, self.whole_bytes)
        # The sender's checksum overlaps the transfer (xxhash releases the GIL).
        expected = self._pool.submit(checksum, [tensors[name] for name in plan_order(plan)])
        todo, ok, dropped, attempts, failures = list(dict.fromkeys(members)), [], [], 0, 0
        phases = dict.fromkeys(("announce", "join", "send", "confirm"), 0.0)
        while todo and not deadline.expired and attempts < self.max_attempts:
            attempts += 1
            last = attempts == self.max_attempts
            budget = deadline if last else deadline.sooner(deadline.left() / 2)
            out = self._attempt(version, todo, tensors, manifest, plan, budget, expected, phases)
            ok += out.acked
            dropped += out.lost
            failures += bool(out.retry or out.lost)
            todo = out.retry
        dropped += todo
        order = list(dict.fromkeys(members))
        # Report in the caller's order, not in order of arrival.
        ok, dropped = sorted(ok, key=order.index), sorted(dropped, key=order.index)
        result = SyncResult(
            version=version,
            epoch=self.epoch,
            members_ok=ok,
            members_dropped=dropped,
            seconds=time.monotonic() - start,
            bytes=manifest.nbytes,
            checksum=_within(expected, deadline),
            manifest_digest=manifest.digest,
            attempts=attempts,
            failures=failures,
            phases=phases,
        )
        metrics.record(
            backend=self.backend.name,
            seconds=result.seconds,
            nbytes=result.bytes,
            ok=len(ok),
            dropped=len(dropped),
            failures=result.failures,
        )
        return result

    def _attempt(self, version, members, tensors, manifest, plan, budget: Deadline, expected,
                 phases: dict[str, float]) -> _Outcome:
        # Same members as the last fully confirmed round: keep its epoch and group. Anything else (a change of
        # members, a failure, a repeat of the same version) starts a new epoch with a new group.
        t0 = time.monotonic()
        reuse = self._live is not None and self._live[1] == tuple(members) and self._live[2] != version
        if not reuse:
            self.epoch += 1
        self._live = None
        es = epoch_store(self.store, self.epoch)
        rs = round_store(es, version)
        # Collectives get 80% of the attempt, so receivers that fail with them still have time to nack.
        transfer = budget.sooner(budget.left() * 0.8)
        meta = {
            "bucket_bytes": self.bucket_bytes,
            "whole_bytes": self.whole_bytes,
            "timeout_s": transfer.left(),
            "new_group": not reuse,
        }
        put_json(rs, "meta", meta)
        ann = self.announcement(version, self.epoch, members, manifest.digest)
        publish_to_store(self.store, ann)
        if self.publish is not None:
            try:
                self.publish(ann)
            except Exception as exc:  # noqa: BLE001 - a receiver that missed it does not join: judged below
                # e.g. a JetStream ack that did not come in time on a loaded broker: the round goes on (the
                # store holds the announcement too), and a member that never joins is retried or dropped.
                log.warning("weights: epoch %d (version %d) announcement not published: %r", self.epoch, version,
                            exc)
        t1 = time.monotonic()
        phases["announce"] += t1 - t0

        joined_keys = wait_keys(rs, [f"joined/{m}" for m in members], budget.sooner(self.join_timeout_s))
        joined = [m for m in members if f"joined/{m}" in joined_keys]
        t2 = time.monotonic()
        phases["join"] += t2 - t1
        if len(joined) < len(members):
            # No data moved, so the joined members are free: retry at once in a new epoch, without the absent.
            rs.set("go", "abandon")
            return _Outcome(retry=joined, lost=[m for m in members if m not in joined])
        rs.set("go", "start")

        ep = Epoch(
            group_store=es,
            store=rs,
            epoch=self.epoch,
            version=version,
            rank=0,
            world_size=1 + len(members),
            plan=plan,
            host=self.host,
            path=self.path,
            collective_timeout_s=transfer.left(),
            new_group=not reuse,
        )
        try:
            self.backend.send(ep, tensors, transfer)
        except Exception as exc:  # noqa: BLE001 - a failed send is judged member by member from acks below
            log.warning("weights: epoch %d (version %d) send failed: %r", self.epoch, version, exc)
            rs.set(ABORT_KEY, repr(exc)[:500])
        t3 = time.monotonic()
        phases["send"] += t3 - t2
        try:
            out = self._confirmations(es, version, members, budget, expected)
        finally:
            self.backend.release(ep)
            phases["confirm"] += time.monotonic() - t3
        if len(out.acked) == len(members):
            self._live = (self.epoch, tuple(members), version)
        return out

    def _confirmations(self, es, version, members, budget: Deadline, expected) -> _Outcome:
        out = _Outcome()
        waiting = set(members)
        for sleep in poll_intervals():
            for m in list(waiting):
                # An ack counts only once it can be compared with the trainer's own checksum.
                if expected.done() and es.check([f"ack/{version}/{m}"]):
                    good = es.get(f"ack/{version}/{m}").decode() == expected.result()
                    (out.acked if good else out.retry).append(m)
                    waiting.discard(m)
                elif es.check([f"nack/{version}/{m}"]):
                    out.retry.append(m)
                    waiting.discard(m)
            if not waiting or budget.expired:
                break
            self.backend.wait(sleep)
        out.lost = [m for m in members if m in waiting]
        return out

    def close(self) -> None:
        self.backend.close()
        self._pool.shutdown(wait=False)


def _within(future, deadline: Deadline) -> str:
    """The sender's checksum if it is ready by the deadline, else "" (the sync never waits past it)."""
    try:
        return future.result(timeout=max(0.0, deadline.left()))
    except TimeoutError:
        return ""


class WeightReceiver:
    """Rollout side. Joins the epochs it is announced in and fills the model's tensors in place."""

    def __init__(self, worker_id: str, backend: str = "gloo", *, host: str | None = None):
        """`host` is the address peers reach this worker at; by default the route towards the store's host."""
        self.worker_id = worker_id
        self.backend: Backend = make_backend(backend)
        self.host = host
        self._stores: dict[str, Any] = {}

    def receive(
        self,
        announcement: Announcement | Mapping[str, Any] | Any,
        into: Mapping[str, torch.Tensor],
        timeout_s: float,
    ) -> str:
        """Join the announced epoch and load its version into `into`; returns the checksum it acked.

        `announcement`: an `Announcement`, a mapping of its fields, or a `WeightAnnouncement` message.
        Raises ManifestMismatch, EpochAbandoned, TransferFailed or TimeoutError.
        """
        ann = Announcement.parse(announcement)
        if ann.backend != self.backend.name:
            raise ValueError(f"announcement is for {ann.backend!r}; this receiver runs {self.backend.name!r}")
        if self.worker_id not in ann.members:
            raise ValueError(f"{self.worker_id!r} is not a member of epoch {ann.epoch}")
        manifest = Manifest.of(into)
        if manifest.digest != ann.manifest_digest:
            raise ManifestMismatch(
                f"{self.worker_id}: local manifest {manifest.digest[:12]} != announced "
                f"{ann.manifest_digest[:12]} (version {ann.version}); the rollout model's names, shapes or "
                "dtypes differ from the trainer's"
            )
        deadline = Deadline(timeout_s)
        es = epoch_store(self._store(ann.store_address, deadline), ann.epoch)
        rs = round_store(es, ann.version)
        meta = get_json(rs, "meta")
        # The sender's collectives end `timeout_s` after it wrote meta; ending ours no later keeps us in step.
        deadline = deadline.sooner(meta["timeout_s"])
        rs.set(f"joined/{self.worker_id}", "1")
        if wait_key(rs, "go", deadline, f"go of epoch {ann.epoch}") == b"abandon":
            raise EpochAbandoned(f"epoch {ann.epoch} abandoned before transfer")
        ep = Epoch(
            group_store=es,
            store=rs,
            epoch=ann.epoch,
            version=ann.version,
            rank=ann.members.index(self.worker_id) + 1,
            world_size=1 + len(ann.members),
            plan=plan_buckets(manifest, meta["bucket_bytes"], meta["whole_bytes"]),
            host=self.host or local_ip_towards(split_address(ann.store_address)[0]),
            path=ann.path,
            collective_timeout_s=meta["timeout_s"],
            new_group=meta["new_group"],
        )
        received = Checksum()

        def fold(bucket: Bucket) -> None:  # buckets arrive in plan order, as the sender's checksum chains them
            received.update(into[slot.spec.name] for slot in bucket.slots)

        try:
            self.backend.receive(ep, into, deadline, fold)
        except Exception as exc:
            es.set(f"nack/{ann.version}/{self.worker_id}", repr(exc)[:500])
            raise TransferFailed(f"{self.worker_id}: epoch {ann.epoch} version {ann.version}: {exc}") from exc
        value = received.hexdigest()
        es.set(f"ack/{ann.version}/{self.worker_id}", value)
        return value

    def _store(self, address: str, deadline: Deadline):
        if address not in self._stores:
            self._stores[address] = connect_store(address, deadline)
        return self._stores[address]

    def close(self) -> None:
        self.backend.close()
        self._stores.clear()
