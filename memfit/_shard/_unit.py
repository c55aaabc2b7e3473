"""A sharded unit: the parameters of one module (minus its sharded submodules), gathered and
freed together, with one flat buffer per collective; and `ShardedModule`, the mixin through
which a sharded module holds its unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard import _collectives as comm
from memfit._shard._param import ShardedParam

if TYPE_CHECKING:
    from memfit._shard._runtime import RootState


class ShardState(Enum):
    SHARDED = auto()  # live: the local chunks; the full tensors have empty storage
    GATHERING = auto()  # live: the chunks and the all-gather buffer; the collective is in flight
    UNSHARDED = auto()  # live: the chunks and the full tensors, which the modules now register


class TrainingState(Enum):
    IDLE = auto()  # between steps
    FORWARD = auto()  # inside the unit's forward
    BACKWARD = auto()  # its backward has started (pre-backward ran), gradients not yet reduced
    REDUCED = auto()  # gradients reduce-scattered into the shards for this step


class Unit:
    """The parameters one ``shard()`` call manages, and what moves them."""

    def __init__(
        self,
        module: nn.Module,
        params: list[ShardedParam],
        group,
        reshard_after_forward: bool,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.reduce_dtype = reduce_dtype  # mixed precision: gradients summed in this dtype
        self.input_dtype: torch.dtype | None = None  # mixed precision: floating inputs cast to this
        self.params = params
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.reshard_after_forward = reshard_after_forward
        self.name = type(module).__name__  # replaced by its path once the root knows it
        self.index = 0  # position in the root's list of units; checked in every all-gather
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.pending_backward = 0  # forward calls whose post-backward has not fired yet
        self.sync_grads = True  # False inside no_sync(): keep full gradients, reduce later
        self.unsynced = False  # full gradients from no_sync steps wait to be reduced
        self.reduce_at_end = False  # a forward call had no input needing grad: reduce in finish_backward
        self._gathered_versions: list[int] = []  # the shards' versions the gather started from
        self._gather: tuple[dist.Work, torch.Tensor] | None = None
        self.managed: list[nn.Module] = []  # the modules whose parameters this unit owns
        # Tied uses of parameters a unit outside this module owns: a common ancestor takes them.
        self.pending_ties: list[tuple[nn.Parameter, nn.Module, str]] = []
        self.parent: Unit | None = None  # the unit directly above, once it is sharded
        self.root_state: RootState | None = None  # shared under the root, set at its first forward

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} params, {self.shard_state.name})"

    # -- all-gather ---------------------------------------------------------------------------

    def _slot_numel(self) -> int:
        return sum(p.slot_numel for p in self.params) + 1  # + the unit index, to catch divergence

    def unshard(self) -> None:
        """Start the all-gather of this unit's parameters (no-op if gathered or gathering)."""
        # See [Note: Sharded parameter layout] and [Note: Mixed precision]
        if self.shard_state is not ShardState.SHARDED or not self.params:
            return
        device = self.params[0].full.device  # the compute device (shards may be offloaded)
        # Gathered in the compute dtype when all parameters share one (mixed precision: half the
        # bytes), else in the shards' dtype and cast when copied out.
        dtypes = {p.full.dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else self.params[0].sharded.dtype
        # Padding after each chunk is never read back, so the buffer is not zeroed.
        send = torch.empty(self._slot_numel(), dtype=dtype, device=device)
        offset = 0
        for p in self.params:
            send[offset : offset + p.local_numel].copy_(p.sharded.detach().reshape(-1))
            offset += p.slot_numel
        send[-1] = self.index % 256  # exact in every float dtype down to bf16
        out = torch.empty(self.world * send.numel(), dtype=dtype, device=device)
        self._gather = (comm.all_gather(out, send, self.group), out)
        self._gathered_versions = [p.sharded._version for p in self.params]
        self.shard_state = ShardState.GATHERING

    def wait_unshard(self) -> None:
        """Finish the all-gather; the modules then compute with the full parameters."""
        if self.shard_state is ShardState.SHARDED:
            self.unshard()
        if self.shard_state is not ShardState.GATHERING:
            return
        work, out = self._gather
        self._gather = None
        comm.wait(work, f"all-gather of sharded unit '{self.name}'", self.group)
        if [p.sharded._version for p in self.params] != self._gathered_versions:
            # The shards changed (an optimizer step) since a prefetch started: gather again.
            self.shard_state = ShardState.SHARDED
            self.unshard()
            return self.wait_unshard()
        slots = out.view(self.world, -1)
        ids = slots[:, -1].tolist()
        if any(i != self.index % 256 for i in ids):
            raise RuntimeError(
                f"memfit sharding: rank {self.rank} gathered unit '{self.name}' (#{self.index}) while the ranks sent "
                f"units {[int(i) for i in ids]}: ranks diverged (one skipped or reordered a forward)."
            )
        offset = 0
        for p in self.params:
            p.full.requires_grad_(p.sharded.requires_grad)  # follows freezing after sharding
            full = p.alloc_full()
            for r in range(self.world):
                rows = p.rows_of(r)
                if rows:
                    start = r * p.chunk_rows
                    full[start : start + rows].view(-1).copy_(slots[r, offset : offset + rows * p.row_numel])
            p.register(p.full)
            offset += p.slot_numel
        self.shard_state = ShardState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters; the modules register their local chunks again."""
        if self.shard_state is ShardState.GATHERING:
            self.wait_unshard()
        if self.shard_state is not ShardState.UNSHARDED:
            return
        for p in self.params:
            p.register(p.sharded)
            p.free_full()
        self.shard_state = ShardState.SHARDED

    # -- reduce-scatter -----------------------------------------------------------------------

    def reduce_grads(self) -> None:
        """Reduce-scatter the gradients and wait for it (see :meth:`start_reduce`)."""
        pending = self.start_reduce()
        if pending is not None:
            pending.finish()

    def start_reduce(self) -> PendingReduce | None:
        """Start summing the full gradients over ranks into the local chunks' ``.grad``
        (divided by W, when the returned handle finishes); frees the full gradients.

        Each rank's slot holds its rows of every trainable parameter's gradient, then one
        "has a gradient" flag per parameter (in every slot): after the reduce-scatter, a
        parameter that no rank used keeps ``grad = None``, as in single-process training.
        The slot ends with i = unit index mod 64 and i*i: their sums over ranks are W*i and
        W*i*i only if every rank reduced the same unit (else the sums of squares differ). The
        check runs for fp32/fp64 gradients; in 16-bit floats those sums would round, and a
        divergence is left to the all-gather check (unit index mod 256) and the timeout.
        """
        trainable = [p for p in self.params if p.sharded.requires_grad]
        if not trainable:
            return
        grad_numel = sum(p.slot_numel for p in trainable)
        flags = grad_numel
        slot = grad_numel + len(trainable) + 2
        # The gradients' own dtype, or fp32 where a unit mixes dtypes (fp32 norms with bf16 layers)
        # unless a reduce dtype was asked for.
        grad_dtypes = {p.full.dtype for p in trainable}
        common = grad_dtypes.pop() if len(grad_dtypes) == 1 else torch.float32
        dtype, device = self.reduce_dtype or common, trainable[0].full.device
        # Not zeroed: padding, and the gradient slots of a parameter whose flag is 0, are never read.
        send = torch.empty(self.world, slot, dtype=dtype, device=device)
        send[:, flags:] = 0
        offset = 0
        for k, p in enumerate(trainable):
            g = p.full.grad
            if g is not None:
                g = g.reshape(p.rows, p.row_numel)
                for r in range(self.world):
                    rows = p.rows_of(r)
                    if rows:
                        start = r * p.chunk_rows
                        send[r, offset : offset + rows * p.row_numel].copy_(g[start : start + rows].reshape(-1))
                send[:, flags + k] = 1
            p.full.grad = None
            offset += p.slot_numel
        send[:, -2] = self.index % 64
        send[:, -1] = (self.index % 64) ** 2
        out = torch.empty(slot, dtype=dtype, device=device)
        work = comm.reduce_scatter(out, send.view(-1), self.group)
        return PendingReduce(self, trainable, work, send, out)


class PendingReduce:
    """A reduce-scatter in flight; `finish` waits and writes the gradient shards."""

    def __init__(self, unit: Unit, trainable: list[ShardedParam], work, send: torch.Tensor, out: torch.Tensor):
        self.unit, self.trainable, self.work, self.send, self.out = unit, trainable, work, send, out

    def finish(self) -> None:
        unit, trainable, out = self.unit, self.trainable, self.out
        comm.wait(self.work, f"reduce-scatter of sharded unit '{unit.name}'", unit.group)
        self.send = None  # free the send buffer
        grad_numel = sum(p.slot_numel for p in trainable)
        flags = grad_numel
        i = unit.index % 64
        exact = out.dtype in (torch.float32, torch.float64)  # sums of squares round in 16-bit floats
        if exact and (out[-2].item() != unit.world * i or out[-1].item() != unit.world * i * i):
            raise RuntimeError(
                f"memfit sharding: rank {unit.rank} reduced the gradients of unit '{unit.name}' (#{unit.index}) "
                "while other ranks reduced another unit: ranks diverged (one skipped or reordered a forward "
                "or backward)."
            )
        out.div_(unit.world)
        offset = 0
        for k, p in enumerate(trainable):
            if out[flags + k] > 0:
                g = out[offset : offset + p.local_numel].view(p.sharded.shape)
                g = g.to(device=p.sharded.device, dtype=p.sharded.dtype)  # to host memory when offloaded
                if p.sharded.grad is None:
                    p.sharded.grad = g.clone()
                else:
                    p.sharded.grad.add_(g)
            offset += p.slot_numel


class ShardedModule:
    """Mixed into every sharded module's class: the controls of its unit and those below.

    The module's unit is its ``_memfit_unit`` attribute."""

    def _units_below(self) -> list[Unit]:
        return [m._memfit_unit for m in self.modules() if isinstance(m, ShardedModule)]  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally, without communication; the next synced backward
        reduces the sum (same result as one large batch, more memory meanwhile)."""
        units = self._units_below()
        for u in units:
            u.sync_grads = False
        try:
            yield
        finally:
            for u in units:
                u.sync_grads = True


def user_class(module: nn.Module) -> type:
    """The module's own class, without memfit's mixins."""
    return next(c for c in type(module).__mro__ if not issubclass(c, ShardedModule))


def units_of(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, in ``modules()`` order; refuses a model with none."""
    units = [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]
    if not units:
        raise ValueError(f"memfit: {type(model).__name__} has no sharded modules (call memfit.shard first)")
    return units
