"""Prometheus metrics of the weight channel, recorded by `WeightSender.sync` once per sync (all attempts)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SYNC_SECONDS = Histogram(
    "weight_sync_seconds",
    "Wall time of one weight sync, all attempts included.",
    ["backend"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
SYNC_BYTES = Counter(
    "weight_sync_bytes_total", "Payload bytes delivered, summed over confirmed members.", ["backend"]
)
SYNC_FAILURES = Counter(
    "weight_sync_failures_total", "Failed attempts (an epoch that did not confirm every member).", ["backend"]
)
SYNC_MEMBERS = Gauge("weight_sync_members", "Members in the last sync, by outcome.", ["backend", "outcome"])


def record(*, backend: str, seconds: float, nbytes: int, ok: int, dropped: int, failures: int) -> None:
    """Record one finished sync."""
    SYNC_SECONDS.labels(backend).observe(seconds)
    SYNC_BYTES.labels(backend).inc(nbytes * ok)
    SYNC_FAILURES.labels(backend).inc(failures)
    SYNC_MEMBERS.labels(backend, "ok").set(ok)
    SYNC_MEMBERS.labels(backend, "dropped").set(dropped)
