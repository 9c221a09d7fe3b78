"""The documented path of the weight-sync SDK; it lives in `rlserve.sdk` (`weight_sync`, the
transports' trainer halves in `senders`)."""

from rlserve.sdk.senders import ShmSender, TensorSender
from rlserve.sdk.weight_sync import LoraSyncStats, SyncStats, WeightSync, WeightSyncError

__all__ = ["LoraSyncStats", "ShmSender", "SyncStats", "TensorSender", "WeightSync", "WeightSyncError"]
