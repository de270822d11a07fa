"""Rendezvous for the weight channel: the announcement, the trainer's TCPStore, per-epoch keys, deadlines.

The trainer hosts one `TCPStore`. Every sync epoch lives under its own prefix, and every version's round
under a prefix inside it, so a dead epoch's keys never confuse a later one:

    announce/latest                       JSON announcement of the newest round (NATS fallback; tests)
    epoch/{e}/...                         the epoch's process-group rendezvous (gloo/nccl), once per epoch
    epoch/{e}/v{v}/meta                   JSON: bucket_bytes, whole_bytes (plan inputs), timeout_s, new_group
    epoch/{e}/v{v}/joined/{worker_id}     receiver is alive and has checked the manifest digest
    epoch/{e}/v{v}/go                     "start" (every member joined) or "abandon" (dropped before data)
    epoch/{e}/v{v}/abort                  sender's send failed; receivers stop waiting and nack
    epoch/{e}/v{v}/<backend>/...          backend side channel (NIXL agent metadata, filesystem file name)
    epoch/{e}/ack/{v}/{worker_id}         checksum of what the receiver loaded: the confirmation
    epoch/{e}/nack/{v}/{worker_id}        receiver is alive but the transfer failed: retry it in a new epoch

Nothing here blocks without a deadline: store waits are bounded polls.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

ANNOUNCE_KEY = "announce/latest"
# Store polls back off from POLL_MIN_S to POLL_S: a key that appears soon (a join, "go", an ack; each a
# few microseconds of store round trip) is seen within a fraction of a millisecond, while a long wait
# costs the trainer's store at most 200 checks a second per waiter.
POLL_MIN_S, POLL_S = 0.0002, 0.005
ABORT_KEY = "abort"


class Deadline:
    """A point in monotonic time; every wait in the channel is bounded by one."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds remaining, never negative."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.left() <= 0.0

    def timedelta(self, floor_s: float = 0.05) -> timedelta:
        """Remaining time for torch APIs; floored, because a zero timeout means "forever" to some of them."""
        return timedelta(seconds=max(floor_s, self.left()))

    def sooner(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now, or this one if that is earlier."""
        d = Deadline(seconds)
        d.at = min(d.at, self.at)
        return d


@dataclass(kw_only=True, slots=True)
class Announcement:
    """The fields of the `WeightAnnouncement` proto (flywheel.v1), one per sync epoch."""

    version: int
    """Policy version (optimizer steps taken)."""
    epoch: int
    """Sync epoch; every attempt, including a retry of the same version, gets a new one."""
    manifest_digest: str
    """sha256 of the manifest; receivers must match it."""
    store_address: str
    """host:port of the trainer's TCPStore."""
    backend: str
    """"gloo", "nccl", "nixl" or "filesystem"."""
    members: list[str] = field(default_factory=list)
    """worker_ids in rank order: member i is rank i + 1, the trainer is rank 0."""
    path: str = ""
    """Filesystem backend: directory holding the safetensors files."""

    @property
    def order(self) -> tuple[int, int]:
        """(epoch, version): later rounds compare greater."""
        return (self.epoch, self.version)

    def fields(self) -> dict[str, Any]:
        """Keyword arguments for `flywheel.v1.WeightAnnouncement(**fields)`."""
        return asdict(self)

    @classmethod
    def parse(cls, obj: Announcement | Mapping[str, Any] | Any) -> Announcement:
        """From an Announcement, a mapping of the fields, or a `WeightAnnouncement` proto message."""
        if isinstance(obj, Announcement):
            return obj
        if isinstance(obj, Mapping):
            get = obj.__getitem__
        else:
            get = lambda k: getattr(obj, k)  # noqa: E731 - proto message
        return cls(
            version=int(get("version")),
            epoch=int(get("epoch")),
            manifest_digest=str(get("manifest_digest")),
            store_address=str(get("store_address")),
            backend=str(get("backend")),
            members=list(get("members")),
            path=str(get("path")) if _has(obj, "path") else "",
        )


def _has(obj: Any, key: str) -> bool:
    return key in obj if isinstance(obj, Mapping) else hasattr(obj, key)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def host_store(host: str, port: int) -> TCPStore:
    """The trainer's store (master). Port 0 picks a free port; read it back from `.port`."""
    return TCPStore(host, port, None, True, timedelta(seconds=30), wait_for_workers=False)


def connect_store(address: str, deadline: Deadline) -> TCPStore:
    """A client of the trainer's store; connecting is bounded by `deadline`."""
    host, port = split_address(address)
    return TCPStore(host, port, None, False, deadline.timedelta(), wait_for_workers=False)


def epoch_store(store: Store, epoch: int) -> PrefixStore:
    # PrefixStore inserts the "/" itself: keys become "epoch/{e}/<key>".
    return PrefixStore(f"epoch/{epoch}", store)


def round_store(epoch_store_: Store, version: int) -> PrefixStore:
    """Keys of one version's round inside an epoch: "epoch/{e}/v{version}/<key>"."""
    return PrefixStore(f"v{version}", epoch_store_)


def put_json(store: Store, key: str, value: Mapping[str, Any]) -> None:
    store.set(key, json.dumps(value))


def get_json(store: Store, key: str) -> dict[str, Any]:
    return json.loads(store.get(key))


def poll_intervals(longest_s: float = POLL_S):
    """Sleep lengths for a polling loop: doubling from POLL_MIN_S, then `longest_s` forever."""
    sleep = min(POLL_MIN_S, longest_s)
    while True:
        yield sleep
        sleep = min(sleep * 2, longest_s)


def wait_keys(store: Store, keys: Iterable[str], deadline: Deadline) -> set[str]:
    """Poll until every key exists or the deadline passes; return the keys that exist."""
    missing, present = set(keys), set()
    for sleep in poll_intervals():
        for key in list(missing):
            if store.check([key]):
                missing.discard(key)
                present.add(key)
        if not missing or deadline.expired:
            return present
        time.sleep(sleep)


def wait_key(store: Store, key: str, deadline: Deadline, what: str) -> bytes:
    """Value of `key` as soon as it exists; TimeoutError naming `what` if the deadline passes first.

    Raises RuntimeError at once if the sender marked the epoch failed (`abort` key), rather than waiting out
    the deadline for a key that will never come.
    """
    sleeps = poll_intervals()
    while True:
        if store.check([key]):
            return store.get(key)
        if store.check([ABORT_KEY]):
            raise RuntimeError(f"sender aborted the epoch: {store.get(ABORT_KEY).decode()}")
        if deadline.expired:
            raise TimeoutError(f"timed out waiting for {what} (store key {key!r})")
        time.sleep(next(sleeps))


def publish_to_store(store: Store, ann: Announcement) -> None:
    """Fallback announcement channel: the newest epoch's announcement under `announce/latest`."""
    put_json(store, ANNOUNCE_KEY, ann.fields())


_clients: dict[str, TCPStore] = {}


def poll_announcement(
    store_address: str, *, newer_than: tuple[int, int] = (0, 0), timeout_s: float
) -> Announcement | None:
    """Wait for an announcement whose `(epoch, version)` is after `newer_than` in the trainer's store.

    Rounds are ordered by (epoch, version): a retry gets a new epoch, the next version for the same members
    keeps the epoch. Returns None on timeout.
    """
    deadline = Deadline(timeout_s)
    if store_address not in _clients:
        _clients[store_address] = connect_store(store_address, deadline)
    store = _clients[store_address]
    try:
        for sleep in poll_intervals():
            if deadline.expired:
                break
            if store.check([ANNOUNCE_KEY]):
                ann = Announcement.parse(get_json(store, ANNOUNCE_KEY))
                if ann.order > tuple(newer_than):
                    return ann
            time.sleep(sleep)
    except RuntimeError:  # the trainer went away: reconnect on the next call, let the caller decide now
        _clients.pop(store_address, None)
        raise
    return None


def local_ip_towards(host: str) -> str:
    """This machine's address on the route to `host` (what a peer can reach us at). No packet is sent."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]
