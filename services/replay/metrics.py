"""Prometheus metrics of the replay service (served on telemetry.metrics_port).

Module-level because prometheus_client's registry is process-global: a second store or
servicer in the same process (tests, the benchmark) reuses them instead of re-registering.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BUFFER_GROUPS = Gauge("flywheel_replay_buffer_groups", "Stored, not yet chosen trajectory groups.")
INGESTED = Counter("flywheel_replay_ingested_groups_total", "Trajectory groups stored (duplicates excluded).")
DUPLICATES = Counter("flywheel_replay_duplicate_groups_total", "Redelivered or republished groups ignored.")
DEAD_LETTERS = Counter("flywheel_replay_dead_letters_total", "Malformed messages sent to the dead-letter subject.")
FILTERED = Counter("flywheel_replay_filtered_groups_total",
                   "Groups not stored because their rewards were all equal (dynamic sampling).")
STALE_DROPPED = Counter("flywheel_replay_stale_dropped_total", "Groups evicted because they exceeded max_staleness.")
SAMPLE_SECONDS = Histogram("flywheel_replay_sample_seconds", "Latency of Sample, store round trip included.",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
CHOSEN_STALENESS = Histogram("flywheel_replay_chosen_staleness_steps",
                             "step - version_start of each group handed to the trainer.",
                             buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
