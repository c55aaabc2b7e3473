"""`memfit.export_safetensors`: the full, unsharded weights of a sharded model, in the format
the rest of the ecosystem loads (HF transformers' sharded safetensors layout)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard._unit import ShardedModule

__all__ = ["export_safetensors"]


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str) -> None:
    """Write ``model``'s full weights under their original names to directory ``path``: one
    ``model-0000i-of-0000n.safetensors`` file per sharded unit plus
    ``model.safetensors.index.json`` (and ``config.json`` for HF models), so
    ``model.load_state_dict`` on a plain model and ``from_pretrained(path)`` both load it.
    Every rank must call it; rank 0 writes, holding one unit in full at a time."""
    from safetensors.torch import save_file

    units = [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]
    if not units:
        raise ValueError(f"memfit.export_safetensors: {type(model).__name__} is not sharded")
    group = units[0].group
    rank = dist.get_rank(group)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    n_files = len(units) + 1
    weight_map: dict[str, str] = {}
    total = 0
    sharded_ids: set[int] = set()
    for i, unit in enumerate(units):
        unit.wait_unshard()
        ids = {id(sp.full) for sp in unit.params}
        sharded_ids |= {id(sp.sharded) for sp in unit.params}
        if rank == 0:
            tensors = {
                name: t.detach().clone().contiguous()
                for name, t in model.state_dict(keep_vars=True).items()
                if id(t) in ids
            }
            total += _write(save_file, tensors, path, f"model-{i + 1:05d}-of-{n_files:05d}.safetensors", weight_map)
        unit.reshard()
    if rank == 0:
        rest = {  # buffers and parameters no unit owns
            name: t.detach().clone().contiguous()
            for name, t in model.state_dict(keep_vars=True).items()
            if id(t) not in sharded_ids and name not in weight_map
        }
        total += _write(save_file, rest, path, f"model-{n_files:05d}-of-{n_files:05d}.safetensors", weight_map)
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_file"):
            config.to_json_file(os.path.join(path, "config.json"))
    dist.barrier(group=group)


def _write(save_file, tensors: dict[str, torch.Tensor], path: str, name: str, weight_map: dict[str, str]) -> int:
    save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    for key in tensors:
        weight_map[key] = name
    return sum(t.numel() * t.element_size() for t in tensors.values())
