"""One sharded parameter: its dim-0 chunk on this rank, and the full tensor while it computes."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from memfit._shard._device import fill, moved

if TYPE_CHECKING:
    from memfit._shard._roles import UnitRef

# [Note: Sharded parameter layout]
# A parameter of shape (d0, ...) is split like torch.chunk(p, W, dim=0): every rank's chunk has
# c = ceil(d0 / W) rows except the last non-empty one, and ranks past the end hold an empty
# (0, ...) chunk; a 0-dim parameter counts as one row. The local chunk is a real nn.Parameter,
# registered under the original name in every module that uses it (tied parameters included),
# so optimizers, param groups and state_dict see it as usual.
# For communication each rank contributes a slot of c rows (its chunk, then padding) to the
# unit's flat buffer, so the all-gathered buffer is W slots of equal size, rank-major, and the
# full parameter is rows [0, d0) of the slots laid end to end.
# The full tensor is one nn.Parameter per sharded parameter, allocated once: its storage is
# resized to zero when the unit reshards and refilled in place when it gathers again, so the
# tensors autograd saved in forward (views of the weight) are valid again in backward. That
# storage holds W * c rows, padding included: viewed as (W, c * row numel) it is where every
# rank's slot lands, so one split-copy of the gathered buffer fills all the unit's parameters
# (the parameter itself is a view of its first d0 rows).


class ShardedParam:
    """A parameter owned by one sharded unit.

    Ownership lives on the objects: ``owner`` is the unit that gathers it (a tie can move it
    to an ancestor unit), the parameter it replaced points here through ``sharded_as``, and
    its local chunk through ``shard_of`` (see [Note: Units, roots and tied parameters]).
    """

    def __init__(
        self,
        param: nn.Parameter,
        uses: list[tuple[nn.Module, str]],
        fqn: str,
        rank: int,
        world: int,
        device: torch.device | None = None,
        compute_dtype: torch.dtype | None = None,
        shard_device: torch.device | None = None,
        values: torch.Tensor | None = None,
    ):
        self.fqn = fqn  # path of its first registration, for errors and state dicts
        self.uses = uses  # every (module, attribute) that registers it
        self.shape = param.shape
        self.requires_grad = param.requires_grad
        self.rows = param.shape[0] if param.dim() > 0 else 1
        self.row_numel = math.prod(param.shape[1:])  # 1 for a scalar; shapes with no rows allowed
        self.chunk_rows = math.ceil(self.rows / world)  # rows per rank's slot
        self.slot_numel = self.chunk_rows * self.row_numel
        self.world = world
        start = min(rank * self.chunk_rows, self.rows)
        self.local_rows = min(start + self.chunk_rows, self.rows) - start
        local_shape = (self.local_rows, *param.shape[1:]) if param.dim() > 0 else (self.local_rows,)
        # The chunk lives on the compute device `device`, or in host memory (`shard_device`,
        # CPU offload); the full tensor always on the compute device. A parameter on the meta
        # device has no values yet: its chunk is filled by memfit.materialize or
        # memfit.load_full_state_dict (deferred init). Otherwise the chunk is `values` (this
        # rank's rows of rank 0's parameter, after sync_module_states) or copied from the
        # parameter's rows straight to where it lives: the full parameter never moves (See
        # [Note: Devices and the meta test device]).
        device = device if device is not None else (param.device if not param.is_meta else torch.device("cpu"))
        home = shard_device or device
        self.deferred = param.is_meta
        if self.deferred:
            local = torch.empty(local_shape, dtype=param.dtype, device=home)
        elif values is not None:  # this rank's rows, synced from rank 0 on the compute device
            local = moved(values.detach(), home).reshape(local_shape)  # a fresh tensor already
        else:
            src = param.detach().reshape(self.rows, self.row_numel)
            local = moved(src[start : start + self.local_rows], home, copy=True).reshape(local_shape)
        self.sharded = nn.Parameter(local, requires_grad=param.requires_grad)
        self.owner: UnitRef | None = None  # the Unit that gathers this parameter; set when a unit takes it
        param._memfit_sharded_as = self  # type: ignore[attr-defined]  # the replaced parameter knows what replaced it
        self.sharded._memfit_shard_of = weakref.ref(self)  # type: ignore[attr-defined]
        # Mixed precision: the full parameter computes in `compute_dtype`.
        self.full = nn.Parameter(
            self._padded_full(compute_dtype or param.dtype, device), requires_grad=param.requires_grad
        )
        self.full.untyped_storage().resize_(0)
        # no_sync with a wider reduce dtype: the micro-batches' full gradients summed in it
        self.accumulated_grad: torch.Tensor | None = None
        self.direct = False  # the full tensor is the chunk itself (See [Note: One rank computes on its shards])
        self.register(self.sharded)

    def can_compute_on_shard(self) -> bool:
        """Whether the chunk can stand for the full tensor: one rank holds all of it, in the
        compute dtype, on the compute device, in the parameter's shape."""
        full, chunk = self.full, self.sharded
        same_place = full.dtype == chunk.dtype and full.device == chunk.device
        return self.world == 1 and same_place and full.shape == chunk.shape

    def compute_on_shard(self) -> None:
        """Make the chunk the full tensor: no gather, no copy, no storage to free
        (See [Note: One rank computes on its shards])."""
        self.direct = True
        self.full = self.sharded
        self._padded = self.sharded.data.view(-1)

    def _padded_full(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new full tensor: the first rows of W padded slots of rows (see [Note: Sharded
        parameter layout]); `self._padded` views all of them, for the gather's copy-out."""
        self._padded = torch.empty(self.world * self.slot_numel, dtype=dtype, device=device)
        return self._padded[: self.rows * self.row_numel].view(self.shape)

    def move_full(self, device: torch.device) -> None:
        """Put the (freed) full tensor on ``device``: where the unit computes when offloaded."""
        assert not self.direct, "an offloaded chunk cannot be its own full tensor"
        self.full.data = self._padded_full(self.full.dtype, device)
        self.full.untyped_storage().resize_(0)

    def gather_view(self) -> torch.Tensor:
        """The full tensor's storage as (W, slot_numel): where the all-gather's slots land.
        Through ``.data``, so that refilling does not bump the version counter autograd checks
        on the weights it saved in forward (they get back the values they had)."""
        return self._padded.data.view(self.world, self.slot_numel)

    def rows_of(self, rank: int) -> int:
        start = min(rank * self.chunk_rows, self.rows)
        return min(start + self.chunk_rows, self.rows) - start

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = tensor

    def alloc_full(self) -> torch.Tensor:
        """Refill the full tensor's storage; returns it viewed as (rows, row_numel)."""
        self.refill()
        # .data, not .detach(): refilling must not bump the version counter that autograd
        # checks on the weights it saved in forward (they get back the values they had).
        return self.full.data.view(self.rows, self.row_numel)

    def refill(self) -> None:
        """Refill the full tensor's storage (the gather writes its values next); on the hot
        path, where the view :meth:`alloc_full` returns would go unused."""
        if self.direct:
            return
        st = self.full.untyped_storage()
        nbytes = self._padded.numel() * self._padded.element_size()
        if st.nbytes() != nbytes:
            st.resize_(nbytes)

    def cast_in(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Refill the full tensor where the chunk is all of it (one rank, See [Note: One rank
        computes on its shards]); (destination, source) of the copy that fills it, in the full
        tensor's shape. Both through ``.data``: the copy must not bump the version counter that
        autograd checks on the weights it saved in forward (they get back the values they had),
        and it records no autograd history."""
        full, src = self.full, self.sharded.data
        full.requires_grad_(self.sharded.requires_grad)  # follows freezing after sharding
        st = full.untyped_storage()
        nbytes = self._padded.numel() * self._padded.element_size()
        if st.nbytes() != nbytes:
            st.resize_(nbytes)
        return full.data, src if src.dim() == full.dim() else src.view(self.shape)  # a 0-dim parameter

    def free_full(self) -> None:
        if self.direct:  # the chunk: nothing to free
            return
        try:
            self.full.untyped_storage().resize_(0)
        except RuntimeError:  # exported (e.g. .numpy() inside summon_full_params): leave it to them
            self.move_full(self.full.device)

    def keep_rows(self, full: torch.Tensor, rank: int) -> None:
        """Copy this rank's rows of a full tensor (shaped like the parameter) into the chunk."""
        start = min(rank * self.chunk_rows, self.rows)
        rows = full.detach().reshape(self.rows, self.row_numel)[start : start + self.local_rows]
        fill(self.sharded.detach().view(-1), rows.reshape(-1))  # from the device to the host when offloaded

    @property
    def padded_numel(self) -> int:
        """Elements of the full tensor's storage: W slots of c rows, padding included."""
        return self.world * self.slot_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel


def sharded_as(p: nn.Parameter) -> ShardedParam | None:
    """The sharded parameter that replaced ``p`` (None: ``p`` was never sharded)."""
    return getattr(p, "_memfit_sharded_as", None)


def shard_of(p: torch.Tensor) -> ShardedParam | None:
    """The sharded parameter whose local chunk ``p`` is (None: ``p`` is no chunk)."""
    ref = getattr(p, "_memfit_shard_of", None)
    return ref() if ref is not None else None
