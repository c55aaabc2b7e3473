"""Which units keep their shards and optimizer state on disk, and when their files are read
ahead and released (See [Note: The disk tier] in memfit/_tiers/_disk.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from memfit._shard._unit import Unit
from memfit._tiers import DiskFile, check_room, padded

__all__ = ["DiskUnits"]

READ_AHEAD = 2  # units whose files are read ahead of the one computing (each way)

# optimizer state per parameter, in parameter sizes, for the room check (others: assume two)
_STATE = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.SGD: 1, torch.optim.Adagrad: 1}


class DiskUnits:
    """The disk-tier files of some units of one host step: the shards move in when made; the
    optimizer state after its first step; read ahead in forward and backward, released after
    each unit's forward and step."""

    def __init__(
        self, directory: str, units: list[Unit], optimizer: torch.optim.Optimizer, params: dict[Unit, list]
    ) -> None:
        self.directory, self.optimizer = directory, optimizer
        self.units = units  # in module order: forward's order for a stack of blocks
        per = _STATE.get(type(optimizer), 2) + (1 if any(g.get("amsgrad") for g in optimizer.param_groups) else 0)
        sizes = {u: sum(p.numel() * p.element_size() for p in params[u]) for u in units}
        need = sum(padded(n, len(params[u])) + padded(per * n, per * len(params[u])) for u, n in sizes.items())
        check_room(directory, need)  # before anything is written
        self.params = {u: params[u] for u in units}
        self.param_files: dict[Unit, DiskFile] = {}
        self.state_files: dict[Unit, DiskFile] = {}
        for u in units:
            file = self.param_files[u] = DiskFile(directory, padded(sizes[u], len(params[u])), f"unit '{u.name}'")
            for sp in u.params:
                if any(sp.sharded is p for p in params[u]):
                    sp.sharded.data = file.tensor(sp.sharded.data)
                    if sp.direct:  # See [Note: One rank computes on its shards]: it is its full tensor
                        sp._padded = sp.sharded.data.view(-1)
            file.release(dirty=True)
        self.bytes = need  # what this rank's tier may take on disk (tests read it)
        self._hooks = [h for i, u in enumerate(units) for h in self._hook(i, u)]

    def _hook(self, i: int, unit: Unit) -> Iterable:
        """Read the next units ahead at this unit's forward, the earlier ones at its backward;
        release its shards after its forward."""
        after = self.units[i + 1 + 1 : i + 2 + READ_AHEAD]  # (the next one the gather prefetches now)
        before = self.units[max(0, i - READ_AHEAD) : i + 1]

        def pre(_module, _args) -> None:
            for u in after:
                self.param_files[u].prefetch()

        def post(_module, _args, output) -> None:
            self.param_files[unit].release(dirty=False)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g: self._backward_reaches(before))
                    break

        yield unit.module.register_forward_pre_hook(pre)
        yield unit.module.register_forward_hook(post)

    def _backward_reaches(self, units: list[Unit]) -> None:
        for u in units:
            self.param_files[u].prefetch()
            if u in self.state_files:
                self.state_files[u].prefetch()

    def stepped(self, unit: Unit) -> None:
        """After ``unit``'s optimizer step: its state in its file (moved in at the first step,
        or after a load replaced it), then everything written back and released."""
        if unit not in self.param_files:
            return
        states = [self.optimizer.state.get(p, {}) for p in self.params[unit]]
        tensors = [(s, k) for s in states for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        file = self.state_files.get(unit)
        if tensors and (file is None or not all(file.holds(s[k]) for s, k in tensors)):
            nbytes = sum(s[k].numel() * s[k].element_size() for s, k in tensors)
            size = padded(nbytes, len(tensors))
            file = self.state_files[unit] = DiskFile(self.directory, size, f"unit '{unit.name}'")
            for s, k in tensors:
                s[k] = file.tensor(s[k])
        self.param_files[unit].release(dirty=True)
        if file is not None:
            file.release(dirty=True)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for x in output for t in _tensors(x)]
    if isinstance(output, dict):
        return [t for x in output.values() for t in _tensors(x)]
    return []


def disk_units_of(model: nn.Module, modules) -> set[nn.Module] | None:
    """The modules given for the disk tier, refused where one is not a sharded module of ``model``."""
    if modules is None:
        return None
    chosen = set(modules)
    mine = {m for m in model.modules() if getattr(m, "_memfit_unit", None) is not None}
    odd = [type(m).__name__ for m in chosen if m not in mine]
    if odd:
        raise ValueError(
            f"memfit.host_optimizer: disk_modules must be sharded modules of the model (units); {odd[:3]} are not"
        )
    return chosen
