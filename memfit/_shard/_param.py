"""One sharded parameter: its dim-0 chunk on this rank, and the full tensor while it computes."""

from __future__ import annotations

import math

import torch
from torch import nn

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
# tensors autograd saved in forward (views of the weight) are valid again in backward.


class ShardedParam:
    """A parameter owned by one sharded unit."""

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
    ):
        self.fqn = fqn  # path of its first registration, for errors and state dicts
        self.uses = uses  # every (module, attribute) that registers it
        self.shape = param.shape
        self.requires_grad = param.requires_grad
        self.rows = param.shape[0] if param.dim() > 0 else 1
        self.row_numel = param[0].numel() if param.dim() > 0 else 1
        self.chunk_rows = math.ceil(self.rows / world)  # rows per rank's slot
        self.slot_numel = self.chunk_rows * self.row_numel
        self.world = world
        start = min(rank * self.chunk_rows, self.rows)
        self.local_rows = min(start + self.chunk_rows, self.rows) - start
        local_shape = (self.local_rows, *param.shape[1:]) if param.dim() > 0 else (self.local_rows,)
        # A parameter on the meta device has no values yet: its chunk is allocated on `device`
        # and filled by memfit.materialize or memfit.load_full_state_dict (deferred init).
        self.deferred = param.is_meta
        if self.deferred:
            device = device or torch.device("cpu")
            local = torch.empty(local_shape, dtype=param.dtype, device=device)
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
        else:
            data = param.detach().reshape(self.rows, self.row_numel)[start : start + self.local_rows]
            local, full = data.clone().reshape(local_shape), torch.empty_like(param)
        if shard_device is not None:  # CPU offload: the chunk lives in host memory
            local = local.to(shard_device)
        self.sharded = nn.Parameter(local, requires_grad=param.requires_grad)
        if compute_dtype is not None:  # mixed precision: the full parameter computes in this dtype
            full = full.to(compute_dtype)
        self.full = nn.Parameter(full, requires_grad=param.requires_grad)
        self.full.untyped_storage().resize_(0)
        self.register(self.sharded)

    def rows_of(self, rank: int) -> int:
        start = min(rank * self.chunk_rows, self.rows)
        return min(start + self.chunk_rows, self.rows) - start

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = tensor

    def alloc_full(self) -> torch.Tensor:
        """Refill the full tensor's storage; returns it viewed as (rows, row_numel)."""
        st = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if st.nbytes() != nbytes:
            st.resize_(nbytes)
        # .data, not .detach(): refilling must not bump the version counter that autograd
        # checks on the weights it saved in forward (they get back the values they had).
        return self.full.data.view(self.rows, self.row_numel)

    def free_full(self) -> None:
        try:
            self.full.untyped_storage().resize_(0)
        except RuntimeError:  # exported (e.g. .numpy() inside summon_full_params): leave it to them
            self.full.data = torch.empty_like(self.full.data)
            self.full.untyped_storage().resize_(0)

    def keep_rows(self, full: torch.Tensor, rank: int) -> None:
        """Copy this rank's rows of a full tensor (shaped like the parameter) into the chunk."""
        start = min(rank * self.chunk_rows, self.rows)
        rows = full.detach().reshape(self.rows, self.row_numel)[start : start + self.local_rows]
        self.sharded.detach().view(-1).copy_(rows.reshape(-1))

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel
