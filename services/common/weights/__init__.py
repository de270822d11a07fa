"""Weight channel: trainer -> rollout transfer of policy weights (see docs/weight_sync.md).

Public API: `WeightSender`, `WeightReceiver`, `SyncResult`, `Announcement`, `poll_announcement`,
`Manifest`, `plan_buckets`, `checksum`, `make_backend`. Importing this package imports torch.
"""

from services.common.weights.backends import make_backend
from services.common.weights.channel import (
    EpochAbandoned,
    ManifestMismatch,
    SyncResult,
    TransferFailed,
    WeightReceiver,
    WeightSender,
)
from services.common.weights.manifest import Manifest, checksum, plan_buckets
from services.common.weights.rendezvous import Announcement, poll_announcement

__all__ = [
    "Announcement",
    "EpochAbandoned",
    "Manifest",
    "ManifestMismatch",
    "SyncResult",
    "TransferFailed",
    "WeightReceiver",
    "WeightSender",
    "checksum",
    "make_backend",
    "plan_buckets",
    "poll_announcement",
]
