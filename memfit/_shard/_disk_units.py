"""Which units keep their shards, gradients and optimizer state on disk, and when their files
are read ahead and released (See [Note: The disk tier] in memfit/_tiers/_disk.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memfit._shard._grad import ShardGrad, as_shard_grad
from memfit._shard._unit import Unit
from memfit._tiers import DiskFile, check_room, measured_bandwidth, padded, read_ahead

__all__ = ["DiskUnits"]

# optimizer state per parameter, in parameter sizes, for the room check (others: assume two)
_STATE = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.SGD: 1, torch.optim.Adagrad: 1}

# [Note: Gradients on the disk tier]
# A disk unit's gradient shards live in a third file (as large as its parameter shards), so
# that between backward and the step the gradients of the whole model are not in host memory
# either. When a unit's gradients land (its reduce, or autograd's accumulation at one rank), a
# fresh gradient (a view of the reduce's output) is copied into the unit's slot in the file and
# the parameter's .grad becomes that slot (a ShardGrad where the shard group has several ranks,
# as before; the step's checks learn of the new tensor); a gradient already there (accumulation)
# was added into in place. Written behind: released (msync, dropped) at once where the step
# comes later (clipping, overlap=False, a deferred unit), or after the step where it runs in
# backward. The clip (memfit's clip_grads) reads and scales them a unit's file at a time,
# dropping each file once done: the same per-tensor norms stacked in the same order. Read for
# the step: prefetched with the unit's other files ahead of it. The values are the same copies
# of the same sums: bitwise those of the host tier. On an accelerator the copy into the file
# runs on the host step's worker after the gradients' copy to the host (its event), and
# offloaded accumulations added after backward re-dirty the pages until the step: untested
# here (no GPU).


class DiskUnits:
    """The disk-tier files of some units of one host step: the shards move in when made, the
    gradients when they land, the optimizer state after its first step; read ahead in
    forward, backward and the step, released after each unit's forward and step."""

    def __init__(
        self, directory: str, units: list[Unit], optimizer: torch.optim.Optimizer, params: dict[Unit, list]
    ) -> None:
        self.directory, self.optimizer = directory, optimizer
        self.units = units  # in module order: forward's order for a stack of blocks
        per = _STATE.get(type(optimizer), 2) + (1 if any(g.get("amsgrad") for g in optimizer.param_groups) else 0)
        sizes = {u: sum(p.numel() * p.element_size() for p in params[u]) for u in units}
        files = {u: padded(n, len(params[u])) for u, n in sizes.items()}
        need = sum(2 * files[u] + padded(per * n, per * len(params[u])) for u, n in sizes.items())
        check_room(directory, need)  # before anything is written
        self.params = {u: params[u] for u in units}
        self.param_files: dict[Unit, DiskFile] = {}
        self.grad_files: dict[Unit, DiskFile] = {}
        self.state_files: dict[Unit, DiskFile] = {}
        self.grad_slots: dict[Unit, list[torch.Tensor]] = {}  # each parameter's gradient's place in the file
        self._made: list[DiskFile] = []  # every file made: closed by close(), or once the optimizer is collected
        weakref.finalize(optimizer, _close_all, self._made)  # (holds the files, never the optimizer)
        self.bandwidth = measured_bandwidth(directory)  # (read, write) bytes/s, measured once
        self.depth = read_ahead(self.bandwidth[0], max(sizes.values(), default=0))  # units read ahead
        for u in units:
            file = self.param_files[u] = self._file(files[u], f"unit '{u.name}'")
            for sp in u.params:
                if any(sp.sharded is p for p in params[u]):
                    sp.sharded.data = file.tensor(sp.sharded.data)
                    if sp.direct:  # See [Note: One rank computes on its shards]: it is its full tensor
                        sp._padded = sp.sharded.data.view(-1)
            file.release(dirty=True)
            grads = self.grad_files[u] = self._file(files[u], f"the gradients of unit '{u.name}'")
            self.grad_slots[u] = [grads.tensor(p, copy=False) for p in params[u]]
        self.bytes = need  # what this rank's tier may take on disk (tests read it)
        self.watch: Callable[[], None] | None = None  # tests: called as each unit's step ends, before its release
        self._hooks = [h for i, u in enumerate(units) for h in self._hook(i, u)]

    def _file(self, nbytes: int, what: str) -> DiskFile:
        file = DiskFile(self.directory, nbytes, what)
        self._made.append(file)
        return file

    def _hook(self, i: int, unit: Unit) -> Iterable:
        """Read the next units ahead at this unit's forward, the earlier ones at its backward;
        release its shards after its forward."""
        after = self.units[i + 1 + 1 : i + 2 + self.depth]  # (the next one the gather prefetches now)
        before = self.units[max(0, i - self.depth) : i + 1]

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
            self.grad_files[u].prefetch()  # (accumulation adds into them)
            if u in self.state_files:
                self.state_files[u].prefetch()

    def grads_landed(self, unit: Unit, stepping: bool) -> None:
        """``unit``'s gradients are final for this backward: fresh ones move into its file; all
        are written behind unless its step runs now (``stepping``) (See [Note: Gradients on the
        disk tier])."""
        if unit not in self.grad_files:
            return
        checks = unit._checks()
        slots = dict(zip(map(id, self.params[unit]), self.grad_slots[unit]))
        for sp in unit.params:
            slot, grad = slots.get(id(sp.sharded)), sp.sharded.grad
            if slot is None or grad is None or grad.numel() == 0 or self.grad_files[unit].holds(grad):
                continue
            if grad.dtype != slot.dtype or grad.shape != slot.shape:  # (a gradient unlike its parameter)
                continue
            slot.copy_(grad)
            if isinstance(grad, ShardGrad):
                group, device = grad._memfit_spec
                sp.sharded.grad = as_shard_grad(slot, group, device)
            else:
                sp.sharded.grad = slot
            checks.moved_grad(sp, grad)
        if not stepping:  # its backward is done: nothing reads its files before its step
            self.grad_files[unit].release(dirty=True)
            self.param_files[unit].release(dirty=False)

    def before_step(self, unit: Unit) -> None:
        """The step after backward reaches ``unit``: read it and the next ones ahead."""
        at = self.units.index(unit)
        for u in self.units[at : at + 1 + self.depth]:
            for files in (self.param_files, self.grad_files, self.state_files):
                if u in files:
                    files[u].prefetch()

    def stepped(self, unit: Unit) -> None:
        """After ``unit``'s optimizer step: its state in its file (moved in at the first step,
        or after a load replaced it), then everything written back and released."""
        if unit not in self.param_files:
            return
        if self.watch is not None:
            self.watch()
        states = [self.optimizer.state.get(p, {}) for p in self.params[unit]]
        tensors = [(s, k) for s in states for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        file = self.state_files.get(unit)
        if tensors and (file is None or not all(file.holds(s[k]) for s, k in tensors)):
            nbytes = sum(s[k].numel() * s[k].element_size() for s, k in tensors)
            size = padded(nbytes, len(tensors))
            if file is not None:
                file.close()  # (its tensors, replaced by a load, keep its mapping while they live)
            file = self.state_files[unit] = self._file(size, f"the optimizer state of unit '{unit.name}'")
            for s, k in tensors:
                s[k] = file.tensor(s[k])
        self.param_files[unit].release(dirty=True)
        self.grad_files[unit].release(dirty=True)
        if file is not None:
            file.release(dirty=True)

    def files(self) -> list[DiskFile]:
        return [*self.param_files.values(), *self.grad_files.values(), *self.state_files.values()]

    def close(self) -> None:
        """Close every file's descriptor (See [Note: The disk tier]); idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _close_all(self._made)


def _close_all(files: list[DiskFile]) -> None:
    for f in files:
        f.close()


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
