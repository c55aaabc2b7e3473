"""A sharded unit: the parameters of one module (minus its sharded submodules), gathered and
freed together, with one flat buffer per collective; and `ShardedModule`, the mixin through
which a sharded module holds its unit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from enum import Enum, auto
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from memfit._shard import _collectives as comm
from memfit._shard._checks import StepChecks
from memfit._shard._device import copy_in, land, pinning, same_device, to_device, wait_host_copies
from memfit._shard._grad import as_shard_grad
from memfit._shard._layout import Layout, post_forward_group
from memfit._shard._mixed import gradient_divide_factors
from memfit._shard._param import ShardedParam
from memfit._shard._streams import Streams

if TYPE_CHECKING:
    from memfit._shard._root_ref import RootStateRef


class HostHooks(Protocol):
    """What the runtime calls on a unit's host step (memfit._shard._host_step.HostStep; a
    protocol here so that the unit need not import it)."""

    def landed(self, unit: Unit, streams: Streams, stream: str) -> None: ...

    def backward_ended(self) -> None: ...

    def check_clip(self, unit: Unit) -> None: ...


class ShardState(Enum):
    SHARDED = auto()  # live: the local chunks; the full tensors have empty storage
    GATHERING = auto()  # live: the chunks and the all-gather buffer; the collective is in flight
    UNSHARDED = auto()  # live: the chunks and the full tensors, which the modules now register
    PARTIAL = auto()  # live: the chunks and this rank's 1/k of the gathered buffer (partial reshard
    #                   after forward, See [Note: Partial reshard after forward]); full tensors freed


class TrainingState(Enum):
    IDLE = auto()  # between steps
    FORWARD = auto()  # inside the unit's forward
    BACKWARD = auto()  # its backward has started (pre-backward ran), gradients not yet reduced
    REDUCED = auto()  # gradients reduce-scattered into the shards for this step


class GradSync(Enum):
    """Where a unit's full gradients go at its post-backward (see [Note: One sharded training step])."""

    SYNC = auto()  # reduce-scattered when the unit's input gradients arrive; no full gradients kept
    SYNC_AT_END = auto()  # as SYNC, but a forward call this step had no input needing grad, so
    #                       its backward cannot be seen ending: reduced by the end-of-backward callback
    NO_SYNC = auto()  # inside no_sync(), nothing accumulated yet
    ACCUMULATED = auto()  # inside no_sync(): full gradients accumulate in the full parameters' .grad
    HELD = auto()  # no_sync() ended with full gradients held: the next synced backward reduces them

    @property
    def syncs(self) -> bool:
        """Does the post-backward reduce-scatter (outside no_sync)?"""
        return self in (GradSync.SYNC, GradSync.SYNC_AT_END, GradSync.HELD)

    def entering_no_sync(self) -> GradSync:
        return GradSync.ACCUMULATED if self in (GradSync.HELD, GradSync.ACCUMULATED) else GradSync.NO_SYNC

    def leaving_no_sync(self) -> GradSync:
        return {GradSync.ACCUMULATED: GradSync.HELD, GradSync.NO_SYNC: GradSync.SYNC}.get(self, self)


# [Note: One rank computes on its shards]
# Sharded over one rank with no replicas (W = 1, as FSDP2 allows), a parameter's chunk is the
# whole parameter: where it is also in the compute dtype and on the compute device (no mixed
# precision cast, no offload), the chunk itself is the full tensor. The modules keep it
# registered, autograd accumulates its gradient into its .grad, and the unit issues no
# collective and no copy for it: gather, free and reduce are no-ops, so a step costs exactly
# what plain torch costs (the planner's s = 1 terms, [Note: Sharded forecasts], assume this).
# Parameters that need a cast (mixed precision) are cast straight from the chunk into the full
# tensor on the compute stream, as plain torch's autocast casts its weights: one foreach copy
# per unit and dtype, no buffer, no collective; their gradients are cast back into the chunks'
# .grad with one _chunk_cat (and the division, where a divide factor asks for one), and a
# parameter without a gradient keeps the .grad it had (None: as in plain torch). With one
# data-parallel rank there is no rank to diverge from: nothing is recorded for the step's
# checks, so the step reads nothing back to the host (See [Note: Divergence detection]).
# Parameters whose chunks live on the host (offload) still go through the unit's buffers.
# A shard group of one rank under HSDP (replicas > 1: the replicated layout, a (W, 1) mesh)
# computes on its chunks in the same way, as DDP computes on its parameters: no gather and no
# copy in forward; autograd accumulates into the chunks' .grad (no_sync too, unless a wider
# reduce dtype keeps the sum: accumulate_grads), and the synced backward puts every trainable
# chunk's gradient, flags and check sums into one buffer per unit (one _chunk_cat),
# all-reduces it over the replicas and makes the .grad tensors views of it, as DDP's bucket
# views. As in DDP, what is reduced is the accumulated .grad: a gradient kept from an earlier
# step (zero_grad(set_to_none=False), two backwards) is the same on every replica, so the
# mean of (kept + new) is kept + the new mean. That holds for a mean over the W ranks in the
# gradients' own dtype: a chunk with another reduce dtype goes through the unit's buffers (a
# tie two such units share is refused), and set_gradient_divide_factor is refused on a unit
# with direct chunks. Hooks on a direct chunk's gradient accumulation fire with this
# rank's gradient before the all-reduce, as DDP's do. The reduce-scatter is not called (its
# output would be its input), nor is the all-gather for parameters that still need one.


class Unit:
    """The parameters one ``shard()`` call manages, and what moves them."""

    def __init__(
        self,
        module: nn.Module,
        params: list[ShardedParam],
        layout: Layout,
        reshard_after_forward: bool | int,
        reduce_dtype: torch.dtype | None = None,
        *,
        input_dtype: torch.dtype | None = None,
        managed: list[nn.Module] | None = None,
        pending_ties: list[tuple[nn.Parameter, nn.Module, str]] | None = None,
    ) -> None:
        self.module = module
        self.reduce_dtype = reduce_dtype  # mixed precision: gradients summed in this dtype
        self.input_dtype = input_dtype  # mixed precision: floating inputs cast to this
        self.params = params
        for sp in params:
            sp.owner = self
        self.layout = layout  # See [Note: Hybrid sharding]
        self.group = layout.shard  # the parameters are sharded over it
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.world == 1:  # See [Note: One rank computes on its shards]
            for sp in params:
                # replicas reduce a direct chunk's .grad as it is (DDP's way): in its own dtype only
                other = layout.replicate is not None and reduce_dtype not in (None, sp.sharded.dtype)
                if sp.direct and other:  # a tie a unit with another reduce dtype made direct
                    module, name = sp.uses[0]
                    raise ValueError(
                        f"memfit sharding: parameter '{name}' of {type(module).__name__} is tied across units "
                        f"that reduce it in different dtypes ({sp.sharded.dtype} and {reduce_dtype}) on a "
                        "replicated mesh (shard groups of one rank); give the units that share it the same "
                        "mixed precision"
                    )
                if not sp.direct and sp.can_compute_on_shard() and not other:
                    sp.compute_on_shard()
        self.reshard_after_forward = bool(reshard_after_forward)  # after forward, free (or keep 1/k)
        self.post_forward_group = None  # partial reshard: the k ranks backward gathers over
        if not isinstance(reshard_after_forward, bool):
            self.post_forward_group = post_forward_group(layout, reshard_after_forward, "memfit.shard")
            self.reshard_after_forward = reshard_after_forward != 1
        if self.world == 1:  # nothing to keep a piece of
            self.post_forward_group = None
        self._piece: torch.Tensor | None = None  # partial reshard: this rank's rows of the gathered buffer
        self.name = type(module).__name__  # replaced by its path once the root knows it
        self.index = 0  # position in the root's list of units; checked in every all-gather
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.grad_sync = GradSync.SYNC
        # Forward calls (with inputs needing grad) whose backward has not ended yet: a count, not
        # a state, since a unit may run several times in one forward (a shared block) and its
        # post-backward must wait for the last of them.
        self.pending_backward = 0
        self.tail_name = f"{self.name}:reduce-out"  # the traced buffer its reduce's check values are in
        self._gathered_versions: list[int] = []  # the shards' versions the gather started from
        self._gather: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None  # (work, output, send buffer)
        self._gather_plan: GatherLayout | None = None  # built at the first gather
        self._reduce_plans: dict[tuple[int, ...], ReduceLayout] = {}  # per set of trainable parameters
        self._local: bool | None = None  # See _casts_locally
        self._cast_groups: list[list[ShardedParam]] | None = None  # See _cast_in
        self._copied_params: list[ShardedParam] | None = None  # See _copied
        device = params[0].full.device if params else torch.device("cpu")
        self._own_streams, self._own_checks = Streams(device), StepChecks(self.rank, eager=True)  # no root yet
        self.managed = managed or []  # the modules whose parameters this unit owns
        # Tied uses of parameters a unit outside this module owns: a common ancestor takes them.
        self.pending_ties = pending_ties or []
        self.parent: Unit | None = None  # the unit directly above, once it is sharded
        # FSDP2's module setters (See [Note: fully_shard on memfit]):
        self.reshard_after_backward = True  # False: stay gathered after backward (until the shards change)
        self.forward_prefetch: list[Unit] | None = None  # None: the next unit in the recorded order
        self.backward_prefetch: list[Unit] | None = None  # None: the unit before it in that order
        self.divide_factor: float | None = None  # None: the gradients are averaged over the ranks
        self.root_state: RootStateRef | None = None  # shared under the root, set at its first forward
        self.host_step: HostHooks | None = None  # steps its host shards in backward (See [Note: The host step])
        self.staged: tuple[torch.Tensor, list[int]] | None = None  # its next send slot, packed by the host step

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} params, {self.shard_state.name})"

    # -- all-gather ---------------------------------------------------------------------------

    def _gather_layout(self) -> GatherLayout:
        if self._gather_plan is None or self._gather_plan.index != self.index:
            self._gather_plan = GatherLayout(self._copied(), self.index, self.params[0].full.device)
        return self._gather_plan

    def _casts_locally(self) -> bool:
        """One data-parallel rank, every chunk on the compute device: the gather casts the
        chunks into the full tensors and the reduce casts the full gradients into the chunks'
        (See [Note: One rank computes on its shards])."""
        if self._local is None:
            local = all(same_device(p.sharded.device, p.full.device) for p in self.params)
            self._local = local and self.layout.data_parallel == 1
        return self._local

    def _cast_in(self) -> None:
        """One rank (:meth:`_casts_locally`): fill the full tensors from the chunks, on the
        compute stream; one foreach copy per dtype pair, whatever the number of parameters."""
        if self._cast_groups is None:  # by (compute dtype, chunk dtype): CUDA's fast path wants one each
            groups: dict[tuple[torch.dtype, torch.dtype], list[ShardedParam]] = {}
            for p in self._copied():
                groups.setdefault((p.full.dtype, p.sharded.dtype), []).append(p)
            self._cast_groups = list(groups.values())
        for group in self._cast_groups:
            pairs = [p.cast_in() for p in group]
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        self._gathered_versions = [p.sharded._version for p in self._copied()]

    def _copied(self) -> list[ShardedParam]:
        """The parameters that go through the unit's buffers (not the chunks that are their own
        full tensors, See [Note: One rank computes on its shards])."""
        if self._copied_params is None:  # (which chunks are direct is settled when the unit is made)
            self._copied_params = [p for p in self.params if not p.direct]
        return self._copied_params

    def unshard(self) -> None:
        """Start the all-gather of this unit's parameters (no-op if gathered or gathering)."""
        # See [Note: Sharded parameter layout], [Note: Mixed precision] and [Note: Streams and buffer lifetimes]
        if self.shard_state not in (ShardState.SHARDED, ShardState.PARTIAL) or not self.params:
            return
        if not self._copied():  # See [Note: One rank computes on its shards]
            self.shard_state = ShardState.UNSHARDED
            return
        if self._casts_locally():  # See [Note: One rank computes on its shards]
            self._release_held(self._streams())
            self._cast_in()
            self._gather = None  # GATHERING without a collective: wait_unshard registers them
            self.shard_state = ShardState.GATHERING
            return
        layout, streams = self._gather_layout(), self._streams()
        streams.after("gather", "compute")  # the shards are written (optimizer step), or the piece kept
        with streams.on("gather"):
            self._release_held(streams)
            out = torch.empty(self.world * layout.slot, dtype=layout.wire, device=layout.device)
            streams.note("alloc", f"{self.name}:gather-out", "gather")
            if self.shard_state is ShardState.PARTIAL:  # See [Note: Partial reshard after forward]
                send, group = cast(torch.Tensor, self._piece), self.post_forward_group  # kept at reshard
                streams.note("use", f"{self.name}:piece", "gather")  # written on compute, waited for above
            else:  # in place, as FSDP2: this rank's slot of the output is the input
                send, group = out.view(self.world, -1)[self.rank], self.group
                if not self._take_staged(layout, send):  # See [Note: The host step]
                    copy_in(send, layout.send_views, [*(p.sharded.detach() for p in layout.order), layout.tail])
            work = comm.all_gather(out, send, group) if self.world > 1 else None  # one rank: out is send
        self._gather = (work, out, send)
        self._gathered_versions = [p.sharded._version for p in self._copied()]
        self.shard_state = ShardState.GATHERING

    def _take_staged(self, layout: GatherLayout, send: torch.Tensor) -> bool:
        """Copy the shards the host step packed ahead into pinned memory (``self.staged``),
        if they are still the shards' values; then the tail, on the device."""
        staged, self.staged = self.staged, None
        if staged is None or staged[1] != [p.sharded._version for p in layout.order]:
            return False
        to_device(staged[0], send)
        layout.send_views(send)[-1].copy_(layout.tail)
        return True

    def wait_unshard(self) -> None:
        """Finish the all-gather; the modules then compute with the full parameters."""
        if self.shard_state is ShardState.UNSHARDED and self._stale():
            self.reshard()  # kept after backward (reshard_after_backward=False), then an optimizer step
        if self.shard_state in (ShardState.SHARDED, ShardState.PARTIAL):
            self.unshard()
        if self.shard_state is not ShardState.GATHERING:
            return
        if self._gather is None:  # cast at unshard (one rank)
            if self._stale():  # the shards changed (an optimizer step) since: cast again
                self._cast_in()
            for p in self._copied():  # (a direct chunk stays registered: it is the full tensor)
                p.register(p.full)
            self.shard_state = ShardState.UNSHARDED
            return
        work, out, _send = self._gather
        self._gather = None
        streams = self._streams()
        with streams.on("gather"):
            if work is not None:
                comm.wait(work, f"all-gather of sharded unit '{self.name}'", self.group)
            done = streams.record("gather")
        if [p.sharded._version for p in self._copied()] != self._gathered_versions:
            # The shards changed (an optimizer step) since a prefetch started: gather again.
            streams.note("free", f"{self.name}:gather-out", "gather")
            self.shard_state = ShardState.SHARDED
            self.unshard()
            return self.wait_unshard()
        layout = self._gather_layout()
        streams.wait("compute", done)
        ids = torch.empty(self.world, layout.tail.numel(), dtype=layout.wire, device=layout.device)
        for p in layout.order:
            p.full.requires_grad_(p.sharded.requires_grad)  # follows freezing after sharding
            p.refill()
        outs = [
            p.gather_view() if layout.wire is p.full.dtype else p.gather_view().view(layout.wire) for p in layout.order
        ]
        torch.split_with_sizes_copy(out.view(self.world, -1), layout.sizes, dim=1, out=[*outs, ids])
        if self._keeps_piece():
            self._piece = self._rows_to_keep(out)
            streams.note("alloc", f"{self.name}:piece", "compute")
        streams.note("use", f"{self.name}:gather-out", "compute")
        if streams.holds:  # freed once the gather stream waited for the copy-out (See _hold)
            self._hold(f"{self.name}:gather-out", out, streams.record("compute"))
        else:
            streams.note("free", f"{self.name}:gather-out", "gather")
            comm.free_now(out)  # the send buffer is a slot of it, or the kept piece
        for p in layout.order:
            p.register(p.full)
        self._checks().gathered(self, ids[:, 0])
        self.shard_state = ShardState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Free the full parameters; the modules register their local chunks again. After
        forward with a partial reshard, keep this rank's piece of the gathered buffer."""
        if self.shard_state is ShardState.GATHERING:
            self.wait_unshard()
        keep = after_forward and self._piece is not None
        if not keep and self._piece is not None:  # compute waited for the gather that sent it
            self._piece = None
            self._streams().note("free", f"{self.name}:piece", "compute")
        if self.shard_state is ShardState.PARTIAL and not keep:
            self.shard_state = ShardState.SHARDED
        if self.shard_state is not ShardState.UNSHARDED:
            return
        for p in self._copied():  # (a direct chunk is its own full tensor: nothing to free)
            p.register(p.sharded)
            p.free_full()
        self.shard_state = ShardState.PARTIAL if keep else ShardState.SHARDED

    def _stale(self) -> bool:
        """Have the shards changed since the full parameters were gathered from them?"""
        return [p.sharded._version for p in self._copied()] != self._gathered_versions

    def _keeps_piece(self) -> bool:
        """Partial reshard: does this gather (a forward's, not the root's) leave a piece to keep?"""
        forward = self.training_state is TrainingState.FORWARD and self._piece is None
        root = self.root_state is not None and self.root_state.root is self
        return self.post_forward_group is not None and forward and not root

    def _rows_to_keep(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's 1/k of the gathered buffer ``out`` (See [Note: Partial reshard after forward])."""
        k = dist.get_world_size(self.post_forward_group)
        per = self.world // k
        j = dist.get_rank(self.post_forward_group)
        return out.view(self.world, -1)[j * per : (j + 1) * per].clone().view(-1)

    def _hold(self, name: str, out: torch.Tensor, event) -> None:
        """Free the all-gather output ``out`` once the gather stream waited for ``event`` (its
        copy-out): in forward at the next all-gather (or the root's post-forward), so that the
        copy-out overlaps that all-gather, as FSDP2's implicit prefetch; in backward at once,
        as FSDP2 (the copy-out then overlaps the reduce-scatter before it)."""
        forward = self.training_state is TrainingState.FORWARD
        if self.root_state is not None and forward:
            self._release_held(self._streams())
            self.root_state.gather_held = (name, out, event)
        else:
            self._streams().wait("gather", event)
            self._streams().note("free", name, "gather")

    def _release_held(self, streams: Streams) -> None:
        """Free the last all-gather output once the gather stream waited for its copy-out."""
        state = self.root_state
        if state is not None and (held := state.gather_held) is not None:
            streams.wait("gather", held[2])
            streams.note("free", held[0], "gather")
            state.gather_held = None

    def _streams(self) -> Streams:
        return self.root_state.streams if self.root_state is not None else self._own_streams

    def _checks(self) -> StepChecks:
        return self.root_state.checks if self.root_state is not None else self._own_checks

    def forget_param(self, sp: ShardedParam) -> None:
        """Give ``sp`` up: a unit above takes it over (a tied parameter)."""
        self.params.remove(sp)
        self._gather_plan = None
        self._local, self._cast_groups, self._copied_params = None, None, None
        self._reduce_plans.clear()

    # -- reduce-scatter -----------------------------------------------------------------------

    def accumulate_grads(self) -> None:
        """A backward without gradient sync, with a reduce dtype wider than the gradients'
        (bf16 compute, fp32 reduce): add the full gradients to accumulators of the reduce dtype,
        as FSDP2 does, so that the micro-batches' sum is not rounded to bf16 between them;
        the next synced reduce-scatter sends it (:func:`_with_accumulated`)."""
        dtype = self.reduce_dtype
        for p in self.params:
            grad = p.full.grad
            if dtype is None or grad is None or grad.dtype == dtype:
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(dtype)
            else:
                p.accumulated_grad.add_(grad)
            p.full.grad = None

    def reduce_grads(self) -> None:
        """Reduce-scatter the gradients and wait for it (see :meth:`start_reduce`)."""
        pending = self.start_reduce()
        if pending is not None:
            pending.finish()
            if self.root_state is not None:  # outside backward: no end of backward adds for it
                self.root_state.add_on_host()

    def start_reduce(self) -> PendingReduce | None:
        """Start summing the full gradients over ranks into the local chunks' ``.grad``
        (divided by W, when the returned handle finishes); frees the full gradients.

        Each rank's slot holds its rows of every trainable parameter's gradient (zeros for a
        parameter without one on this rank), then one "has a gradient" flag per parameter and
        the two check sums of [Note: Divergence detection]. The flags are read at the end of
        backward with the step's other checks: a parameter that no rank used keeps
        ``grad = None``, as in single-process training.
        """
        # See [Note: One rank computes on its shards]: with no replicas a direct chunk has its
        # gradient already; with replicas it is all-reduced with the others.
        params = self._copied() if self.layout.replicate is None else self.params
        trainable = [p for p in params if p.sharded.requires_grad]
        if not trainable:
            return None
        key = tuple(id(p) for p in trainable)
        layout = self._reduce_plans.get(key)
        if layout is None:
            layout = self._reduce_plans[key] = ReduceLayout(self, trainable)
        grads = [_with_accumulated(p) for p in layout.params]
        if self._casts_locally():
            self._cast_grads(layout, grads)
            return None
        have = tuple(g is not None for g in grads)
        streams = self._streams()
        # As FSDP2's copy-in: on compute, where autograd wrote the gradients, so that they are
        # freed at once (a copy-in on the reduce stream would hold them until compute waited for
        # it, one unit's gradients more than FSDP2). One launch whatever the number of
        # parameters: each gradient's rows, chunked over the ranks' slots (zero-padded), cast to
        # the reduce dtype. The send buffer, written on compute and read by the reduce-scatter,
        # is held until compute waits for the reduce-scatter (in `finish`).
        send = torch.empty(self.world, layout.slot, dtype=layout.dtype, device=layout.device)
        streams.note("alloc", f"{self.name}:send", "compute")
        streams.note("alloc", f"{self.name}:full-grads", "compute")  # autograd wrote them on compute
        layout.copy_in(send, grads, have)
        if layout.pre != 1:  # 16-bit sums: divide before and after (See gradient_divide_factors)
            send.div_(layout.pre)
        streams.note("use", f"{self.name}:full-grads", "compute")
        for p in trainable:
            p.full.grad = None
        grads.clear()
        streams.note("free", f"{self.name}:full-grads", "compute")
        ready = streams.record("compute")  # the send buffer is written (and the shards' old gradients)
        streams.wait("reduce", ready)
        with streams.on("reduce"):
            streams.note("use", f"{self.name}:send", "reduce")
            if self.world > 1:
                out = torch.empty(layout.slot, dtype=layout.dtype, device=layout.device)
                work = comm.reduce_scatter(out, send.view(-1), self.group)
            else:  # one rank: the sum is the input (See [Note: One rank computes on its shards])
                out, work = send.view(-1), None
            streams.note("alloc", f"{self.name}:reduce-out", "reduce")
        return PendingReduce(self, layout, work, (send, ready), out, have)

    def _cast_grads(self, layout: ReduceLayout, grads: list[torch.Tensor | None]) -> None:
        """One rank (:meth:`_casts_locally`): the full gradients ``grads`` (of
        ``layout.params``), cast to the reduce dtype and divided as the reduce-scatter's would
        be, become (or are added to) the chunks' .grad, on the compute stream: one
        ``_chunk_cat`` per gradient dtype into one flat buffer, which the new .grad tensors view.
        A parameter without a gradient keeps its .grad (None: no rank produced one)."""
        pairs = [(p, g) for p, g in zip(layout.params, grads) if g is not None]
        for p in layout.params:
            p.full.grad = None
        if not pairs:
            return
        sizes = [p.local_numel for p, _ in pairs]
        flat = torch.empty(sum(sizes), dtype=layout.dtype, device=layout.device)
        dtypes = dict.fromkeys(g.dtype for _, g in pairs)
        if len(dtypes) == 1:
            torch._chunk_cat([g if g.dim() else g.view(1) for _, g in pairs], 0, 1, out=flat.view(1, -1))
        else:  # accumulated (no_sync) gradients beside fresh ones of another dtype: rare, one copy each
            for (_, g), dst in zip(pairs, torch.split_with_sizes(flat, sizes)):
                dst.copy_(g.reshape(-1))
        if layout.pre != 1:  # as the reduce-scatter (See gradient_divide_factors)
            flat.div_(layout.pre)
        if layout.post != 1:
            flat.div_(layout.post)
        dtype = layout.params[0].sharded.dtype
        if flat.dtype != dtype:
            flat = flat.to(dtype)
        olds, news = [], []
        for (p, _), part in zip(pairs, torch.split_with_sizes(flat, sizes)):
            shape = p.sharded.shape
            g = part if part.shape == shape else part.view(shape)
            if p.sharded.grad is None:
                p.sharded.grad = g
            else:
                olds.append(p.sharded.grad)
                news.append(g)
        if olds:
            torch._foreach_add_(olds, news)


def _aligned(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes: collective slots are multiples of it."""
    return max(1, 16 // dtype.itemsize)


def _with_accumulated(p: ShardedParam) -> torch.Tensor | None:
    """``p``'s full gradient plus what :meth:`Unit.accumulate_grads` set aside (in its dtype)."""
    acc, grad = p.accumulated_grad, p.full.grad
    if acc is None:
        return grad
    p.accumulated_grad = None
    return acc if grad is None else acc.add_(grad)


class GatherLayout:
    """Where each parameter's chunk sits in the unit's all-gather slot, in one wire dtype.

    The wire dtype is the full parameters' dtype when they share one; else (mixed precision
    with fp32 norm layers) bytes: each chunk travels in its own compute dtype, laid out by
    decreasing element size so every chunk is aligned. The slot ends with the unit index (see
    [Note: Divergence detection]), then padding to a multiple of 16 bytes, so that every
    rank's slot starts 16-byte aligned (as NCCL's and the copy kernels' vectorised paths want).
    """

    def __init__(self, params: list[ShardedParam], index: int, device: torch.device) -> None:
        self.index, self.device = index, device
        dtypes = {p.full.dtype for p in params}
        self.wire = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        if self.wire is torch.uint8:
            self.order = sorted(params, key=lambda p: -p.full.element_size())
            scale = [p.full.element_size() for p in self.order]
        else:
            self.order, scale = list(params), [1] * len(params)
        self.sizes = [p.slot_numel * k for p, k in zip(self.order, scale)]  # wire elements per slot
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        body = sum(self.sizes)
        tail = ((-(body + 1)) % _aligned(self.wire)) + 1  # the index, then padding to 16 bytes
        self.tail = torch.zeros(tail, dtype=self.wire, device=device)
        self.tail[0] = index % 256  # exact in every float dtype down to bf16, and in a byte
        self.sizes.append(tail)
        self.slot = body + tail

    def send_views(self, send: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``send`` for each parameter's local chunk (in its compute dtype), then the tail."""
        views = []
        for p, off in zip(self.order, self.offsets):
            if self.wire is torch.uint8:
                n = p.local_numel * p.full.element_size()
                views.append(send[off : off + n].view(p.full.dtype).view(p.sharded.shape))
            else:
                views.append(send[off : off + p.local_numel].view(p.sharded.shape))
        views.append(send[self.slot - self.tail.numel() :])
        return views


class ReduceLayout:
    """Where each trainable parameter's gradient rows sit in the reduce-scatter slots."""

    def __init__(self, unit: Unit, trainable: list[ShardedParam]) -> None:
        # by dtype (fp32 norms beside bf16 layers): each dtype's gradients are adjacent in a slot
        rank = {dt: i for i, dt in enumerate(dict.fromkeys(p.full.dtype for p in trainable))}
        trainable = sorted(trainable, key=lambda p: rank[p.full.dtype])
        self.unit, self.params = unit, trainable
        self.device = trainable[0].full.device
        # The gradients' own dtype, or fp32 where a unit mixes dtypes (fp32 norms with bf16
        # layers) unless a reduce dtype was asked for.
        dtypes = {p.full.dtype for p in trainable}
        self.dtype = unit.reduce_dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
        self.offsets = [sum(p.slot_numel for p in trainable[:i]) for i in range(len(trainable))]
        self.flags = sum(p.slot_numel for p in trainable)
        self.checked = len(trainable) + 2  # the flags and the two check sums after the gradients
        # then padding to 16 bytes: every rank's slot starts aligned
        self.slot = self.flags + self.checked + (-(self.flags + self.checked)) % _aligned(self.dtype)
        self._tails: dict[tuple[bool, ...], torch.Tensor] = {}
        # by the data-parallel ranks (replicas x shards), before and after the sum, or by FSDP2's
        # set_gradient_divide_factor; the check values are scaled to come out of it as i and i*i
        world = unit.layout.data_parallel
        self.pre, self.post = gradient_divide_factors(self.dtype, unit.divide_factor or world)
        self.check_scale = (unit.divide_factor or world) / world
        # sums of squares round in 16-bit floats, and a scale other than a power of two rounds
        self.exact = self.dtype in (torch.float32, torch.float64) and math.frexp(self.check_scale)[0] == 0.5

    def copy_in(self, send: torch.Tensor, grads: list, have: tuple[bool, ...]) -> None:
        """Fill the (W, slot) buffer ``send``: each gradient's rows, chunked over the ranks'
        slots and zero-padded (zeros for a parameter without a gradient here: they add nothing
        to the others' sum), cast to the reduce dtype, then the tail. As FSDP2's copy-in, one
        ``torch._chunk_cat`` (one launch) where the gradients are in the reduce dtype; else one
        per gradient dtype into a buffer of its own, copied into its columns, and the tail's
        copy: a few launches, whatever the number of parameters."""
        zeros = lambda p: torch.zeros(p.rows, p.row_numel, dtype=p.full.dtype, device=self.device)  # noqa: E731
        # a parameter of no rows (MobileBERT's) has no columns in the slots: _chunk_cat refuses it
        pairs = [(p, g) for p, g in zip(self.params, grads) if p.rows * p.row_numel]
        rows = [(zeros(p) if g is None else g).reshape(p.rows, p.row_numel) for p, g in pairs]
        world = self.unit.world
        if all(g.dtype == self.dtype for g in rows):
            torch._chunk_cat([*rows, self.tail(have)], 0, world, out=send)
            return
        start = 0
        for dtype in dict.fromkeys(g.dtype for g in rows):
            group = [(g, p) for g, (p, _) in zip(rows, pairs) if g.dtype == dtype]
            width = sum(p.slot_numel for _, p in group)
            part = torch.empty(world, width, dtype=self.dtype, device=self.device)
            torch._chunk_cat([g for g, _ in group], 0, world, out=part)
            send[:, start : start + width].copy_(part)
            start += width
        send[:, self.flags :].copy_(self.tail(have))

    def tail(self, have: tuple[bool, ...]) -> torch.Tensor:
        """The flags and check values every rank's slot ends with, for this pattern of
        gradients: one row per rank (so that ``torch._chunk_cat`` gives each slot one)."""
        if have not in self._tails:
            i = self.unit.index % 64
            values = [float(h) for h in have] + [i * self.check_scale, i * i * self.check_scale]
            values += [0.0] * (self.slot - self.flags - len(values))  # the padding
            host = torch.tensor([values] * self.unit.world, dtype=self.dtype, pin_memory=pinning())
            if self.device.type == "cpu":
                self._tails[have] = host
            else:  # from pinned memory, without blocking the host (queued on the current stream)
                self._tails[have] = torch.empty_like(host, device=self.device)
                to_device(host, self._tails[have])
        return self._tails[have]


# [Note: Releasing the reduce output]
# A unit's reduce output holds its rank's rows of the reduced gradients, then the "has a
# gradient" flags and check sums that the step's checks read at the next forward ([Note:
# Divergence detection]). Where a gradient shard had none, it becomes a view of the output,
# which then lives as the gradient. Where every shard had one (gradient accumulation without
# no_sync, as memfit train and torchtitan run it; zero_grad(set_to_none=False)), or the shards
# take a copy (offloaded to the host, another dtype), the output is added (or copied) and freed
# at once, its tail copied first: holding it for its tail kept one more copy of the gradient
# shards (every unit's) from each backward to the next forward, through the optimizer step, as
# FSDP2 does not (a 2-rank BERT in bf16 at 1 x 4: 16.18 MiB measured, 15.04 MiB since). It is
# freed on the stream that allocated it and alone used it (the reduce stream). With replicas
# the all-reduce stream used it too, and the reduce stream never waits for that one inside a
# backward (its reduce-scatters would queue behind the all-reduces): a hybrid unit's output is
# freed at the end of backward, once the reduce stream waited for the all-reduce stream (it
# has nothing left to run by then), on the CPU too, so that both hold it as long.


class PendingReduce:
    """A reduce-scatter in flight; `finish` waits and writes the gradient shards."""

    def __init__(self, unit: Unit, layout: ReduceLayout, work, inputs: tuple, out: torch.Tensor, have: tuple):
        self.unit, self.layout, self.work, self.out = unit, layout, work, out
        self.have = have  # which parameters had a gradient on this rank
        self.inputs: tuple | None = inputs  # dropped once finished

    def finish(self) -> None:
        """Wait; the gradient shards are views of the reduced buffer (added where they exist).

        Everything that reads the reduced buffer on the device runs on FSDP2's post-reduce
        stream: the reduce stream, or with replicas the all-reduce stream, which waits for the
        reduce-scatter and then runs the all-reduce (so that the next units' reduce-scatters
        do not queue behind inter-node traffic, as in FSDP2; See [Note: Streams and buffer
        lifetimes]). There run the division, the cast, and the addition into gradients the
        shards already have (two backwards without ``no_sync``, ``zero_grad(set_to_none=
        False)``, ``retain_graph``), which that stream may touch because it waited for the
        compute event the reduce stream waited for before the reduce-scatter. Compute waits
        for the post-reduce event at the end of backward, or at once when it reads the buffer
        here (debug checks)."""
        unit, layout, out = self.unit, self.layout, self.out
        streams = unit._streams()
        name = f"{unit.name}:reduce-out"
        replicate = unit.layout.replicate
        post = "reduce" if replicate is None else "all_reduce"
        send, ready = cast(tuple, self.inputs)
        with streams.on("reduce"):
            if self.work is not None:
                comm.wait(self.work, f"reduce-scatter of sharded unit '{unit.name}'", unit.group)
            scattered = streams.record("reduce")  # the send buffer was read
        if replicate is not None:
            streams.wait(post, ready)
            streams.after(post, "reduce")
        with streams.on(post):
            if replicate is not None:  # hybrid: sum this shard over the replicas (See [Note: Hybrid sharding])
                streams.note("use", name, post)
                comm.wait(comm.all_reduce(out, replicate), f"all-reduce of sharded unit '{unit.name}'", replicate)
            if layout.post != 1:
                out.div_(layout.post)
            out = land(out, layout.params[0].sharded, lambda: streams.record(post))  # offloaded: to the host
            streams.note("use", name, post)
            olds, news = self._shard_grads(out)
            on_host = bool(olds) and not same_device(out.device, self.out.device)
            if olds and not on_host:
                streams.note("use", f"{unit.name}:grad-shards", post)
                torch._foreach_add_(olds, news)
            tail = self.out[layout.flags : layout.flags + layout.checked]
            unit.tail_name = name
            viewed = out is self.out and len(olds) < len(layout.params)  # a fresh gradient shard views it
            held = unit.root_state.outputs_held if unit.root_state is not None else None
            if not viewed and (replicate is None or held is not None):  # See [Note: Releasing the reduce output]
                tail, unit.tail_name = tail.clone(), f"{unit.name}:reduce-tail"
                streams.note("alloc", unit.tail_name, post)  # read as the reduce output's tail was
                if replicate is None:  # the reduce stream alone used it
                    release(streams, name, post, self.out)
                else:  # the all-reduce stream too: freed at the end of backward
                    cast(list, held).append((name, self.out))
            done = streams.record(post)
        # The send buffer was allocated on compute: compute waits before its memory is reused.
        if unit.world > 1:  # for the reduce-scatter, which read it
            streams.wait("compute", scattered)
            streams.note("free", f"{unit.name}:send", "compute")
            if not streams.holds:
                comm.free_now(send)
        elif streams.holds:  # one rank: it is the output, read on the post-reduce stream until `done`
            if unit.root_state is not None:  # compute waits for that at the end of backward
                unit.root_state.reduced_held.append((f"{unit.name}:send", send))
            else:
                streams.wait("compute", done)
                streams.note("free", f"{unit.name}:send", "compute")
        self.inputs = None
        if on_host and unit.root_state is not None:  # after the end of backward's one host wait
            unit.root_state.host_adds.append((olds, news))
        elif on_host:  # no root yet (a unit run on its own): nothing later waits
            wait_host_copies()  # offloaded: the host adds what the device copied
            torch._foreach_add_(olds, news)
        checks = unit._checks()
        if checks.debug:  # the check reads the buffer's tail now, on compute
            streams.wait("compute", done)
            if post != "reduce":
                streams.wait("compute", scattered)  # (done's stream waited for it; the trace wants it direct)
                streams.wait("reduce", done)  # the buffer may be freed after the check: its stream waits too
            streams.note("use", unit.tail_name, "compute")
        checks.reduced(unit, layout.params, tail, layout.exact, self.have)

    def _shard_grads(self, out: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Give each shard without a gradient its view of ``out``; (old gradients, their
        views of ``out``) for the shards that have one."""
        olds, news = [], []
        checks = self.unit._checks()
        for p, off in zip(self.layout.params, self.layout.offsets):
            g = out[off : off + p.local_numel].view(p.sharded.shape)
            if p.sharded.grad is None:
                # See [Note: Sharded gradients and torch's clip_grad_norm_]
                p.sharded.grad = as_shard_grad(g, self.unit.group, self.layout.device)
                checks.fresh_grad(p)
            else:
                olds.append(p.sharded.grad)
                news.append(g)
        return olds, news


def release(streams: Streams, name: str, stream: str, buffer: torch.Tensor) -> None:
    """Free ``buffer`` (traced as ``name``), allocated on ``stream``, whose uses on other
    streams that stream has waited for: on the CPU at once (gloo's worker thread may hold a
    reference of its own), on CUDA when the caller's references go."""
    if not streams.holds:
        comm.free_now(buffer)
    streams.note("free", name, stream)


class ShardedModule:
    """Mixed into every sharded module's class: the controls of its unit and those below.

    The module's unit is its ``_memfit_unit`` attribute."""

    _memfit_unit: Unit  # set on the instance by memfit.shard (see _api._install)

    def _units_below(self) -> list[Unit]:
        return [m._memfit_unit for m in self.modules() if isinstance(m, ShardedModule)]  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally, without communication; the next synced backward
        reduces the sum (same result as one large batch, more memory meanwhile)."""
        units = self._units_below()
        for u in units:
            u.grad_sync = u.grad_sync.entering_no_sync()
        try:
            yield
        finally:
            for u in units:
                u.grad_sync = u.grad_sync.leaving_no_sync()


def user_class(module: object) -> type:
    """The module's own class, without memfit's mixins."""
    return next(c for c in type(module).__mro__ if not issubclass(c, ShardedModule))


def units_of(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, in ``modules()`` order; refuses a model with none."""
    units = [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]
    if not units:
        raise ValueError(f"memfit: {type(model).__name__} has no sharded modules (call memfit.shard first)")
    return units
