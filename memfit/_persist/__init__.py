"""Persistence: checkpoint files of sharded models (any world size), the atomic directory swap
they are written through, asynchronous saves, DCP interop, and the export of full weights.

Beside memfit/_shard/ as torch keeps distributed/checkpoint beside FSDP: sharding owns the
shards, this package reads and writes them; memfit/_shard/ does no file I/O."""

from memfit._persist._checkpoint_files import load_checkpoint, save_checkpoint
from memfit._persist._export import export_safetensors

__all__ = ["export_safetensors", "load_checkpoint", "save_checkpoint"]
