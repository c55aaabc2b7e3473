"""Storage tiers for model state beyond host memory: files on a local disk (See [Note: The disk tier])."""

from memfit._tiers._disk import DiskFile, check_room, measured_bandwidth, padded, read_ahead

__all__ = ["DiskFile", "check_room", "measured_bandwidth", "padded", "read_ahead"]
