"""Storage tiers for model state beyond host memory: files on a local disk (See [Note: The disk tier])."""

from memfit._tiers._disk import DiskFile, check_room, padded

__all__ = ["DiskFile", "check_room", "padded"]
