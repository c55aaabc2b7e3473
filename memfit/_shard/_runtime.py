"""When units gather, free and reduce: the module and autograd hooks of sharding."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit._instrument import HOOKS
from memfit._recompute import is_recomputing
from memfit._shard._checks import StepChecks
from memfit._shard._device import wait_host_copies
from memfit._shard._streams import Streams
from memfit._shard._unit import (
    GradSync,
    PendingReduce,
    ShardState,
    TrainingState,
    Unit,
    release,
)


def grads_landed(unit: Unit, streams: Streams, stream: str) -> None:
    """Hook of the runtime: ``unit``'s gradients for this backward are final on ``stream``
    (See [Note: The host step])."""
    if unit.host_step is not None:
        unit.host_step.landed(unit, streams, stream)


def backward_ended(units: list[Unit]) -> None:
    """Hook of the runtime's end of backward: join each host step of these units."""
    for host in dict.fromkeys(u.host_step for u in units if u.host_step is not None):
        host.backward_ended()


# [Note: One sharded training step]
# Forward, per unit: the pre-forward hook finishes the unit's all-gather (started early by
# the unit before it: forward prefetch), starts the next unit's, and wraps the inputs that
# need a gradient in `_PostBackward`. The post-forward hook hooks the outputs (pre-backward)
# and, with reshard_after_forward, frees the full parameters (the root keeps them: its
# backward comes first).
# Backward, per unit: the first output gradient (pre-backward) gathers the unit again and
# prefetches the unit that ran before it in forward. Recompute of checkpointed blocks inside
# the unit happens after this, so it never gathers a second time. When autograd has produced
# the gradients of the unit's inputs, all parameter gradients of the unit are accumulated
# (autograd runs AccumulateGrad before any earlier node): `_PostBackward` frees the full
# parameters and starts reduce-scattering the gradients into the shards; that finishes while
# the next unit computes (one reduce-scatter in flight at a time). A unit whose inputs need no
# gradient (the embeddings) is reduced by the callback queued at the root's pre-backward,
# which runs when the whole backward ends, finishes the last reduce-scatter, resets every
# unit for the next step and starts copying the step's checks to the host without waiting;
# a later root forward reads them once landed, without a host sync (see [Note: Divergence
# detection]; with one data-parallel rank there are none, See [Note: One rank computes on its shards]).
# Without grad (evaluation) units gather before and free right after their forward.


# Root states between a forward with grad and the end of its backward: held here, so that the
# graph itself need only hold them weakly (a finished graph kept by the user must not hold the model).
_IN_FLIGHT: set = set()


class RootState:
    """Shared by the units under one root (the outermost sharded module); its methods are the
    hooks of [Note: One sharded training step], each called with the unit it concerns."""

    def __init__(self, root: Unit, units: list[Unit]) -> None:
        self.root = root
        self.units = units  # root first, then in module order: the order names and indices come from
        self.forward_order: list[Unit] = []  # recorded in the first step, used to prefetch
        self.order_done = False
        self.callback_queued = False
        self.pending_reduce: PendingReduce | None = None  # the last reduce-scatter, finished when the next starts
        device = next((sp.full.device for u in units for sp in u.params), torch.device("cpu"))
        self.streams = Streams(device)  # See [Note: Streams and buffer lifetimes]
        self.checks = StepChecks(root.rank)  # See [Note: Divergence detection]
        # (name, the last all-gather output, its copy-out event): CUDA only
        self.gather_held: tuple[str, torch.Tensor, Any] | None = None
        # (name, buffer) written on compute and read on a reduce stream, freed at the end of
        # backward once compute waited for those streams (one rank's send buffers): CUDA only
        self.reduced_held: list[tuple[str, torch.Tensor]] = []
        # (name, buffer) reduce outputs a hybrid unit's all-reduce stream used and no gradient
        # views, freed at the end of backward (See [Note: Releasing the reduce output])
        self.outputs_held: list[tuple[str, torch.Tensor]] = []
        # (old gradient shards in host memory, the reduced gradients copied beside them): added
        # after the end of backward's one host wait (See [Note: Devices and the meta test device])
        self.host_adds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def next_in_forward(self, unit: Unit) -> Unit | None:
        if not self.order_done or unit not in self.forward_order:
            return None
        i = self.forward_order.index(unit)
        return self.forward_order[i + 1] if i + 1 < len(self.forward_order) else None

    def prev_in_forward(self, unit: Unit) -> Unit | None:
        if not self.order_done or unit not in self.forward_order:
            return None
        i = self.forward_order.index(unit)
        return self.forward_order[i - 1] if i > 0 else None

    def forward_prefetch(self, unit: Unit) -> list[Unit]:
        """The units to gather once ``unit``'s forward gather is done: FSDP2's
        set_modules_to_forward_prefetch, else the next unit of the recorded order."""
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        nxt = self.next_in_forward(unit)
        return [nxt] if nxt is not None else []

    def backward_prefetch(self, unit: Unit) -> list[Unit]:
        """The units to gather once ``unit``'s backward gather is done (as forward_prefetch)."""
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        prev = self.prev_in_forward(unit)
        return [prev] if prev is not None else []

    # -- forward ------------------------------------------------------------------------------

    def pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        """Gather ``unit`` (prefetch the next), hook the inputs that need a gradient."""
        # See [Note: One sharded training step]
        if is_recomputing():
            # A checkpointed region around this unit is being recomputed in backward: the unit
            # only needs its parameters; its own backward hooks were set in the real forward.
            unit.wait_unshard()
            return None
        grad = torch.is_grad_enabled()
        if grad:  # before the gather finishes: a partial reshard keeps its piece of a forward gather
            unit.training_state = TrainingState.FORWARD
        if unit is self.root:
            _IN_FLIGHT.discard(self)  # a forward without backward before this one
            if grad:
                _IN_FLIGHT.add(self)
            self.checks.settle(wait=False)  # the last backward's checks, when they have landed: no host sync
        if unit is self.root and not self.order_done and self.forward_order:
            self.order_done = True  # the first step's order is known once the root runs again
        if not self.order_done and unit not in self.forward_order:
            self.forward_order.append(unit)
        unit.wait_unshard()
        for nxt in self.forward_prefetch(unit):
            if nxt.training_state is not TrainingState.FORWARD:
                nxt.unshard()
        flat, spec = tree_flatten((args, kwargs))
        if unit.input_dtype is not None:  # mixed precision: floating inputs in the compute dtype
            cast = unit.input_dtype
            flat = [x.to(cast) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in flat]
        if not grad:
            return tree_unflatten(flat, spec) if unit.input_dtype is not None else None
        pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not pos:
            if unit.grad_sync.syncs:  # this call's backward cannot be seen ending: reduce at the end
                unit.grad_sync = GradSync.SYNC_AT_END
            return tree_unflatten(flat, spec) if unit.input_dtype is not None else None
        outs = _PostBackward.apply(unit, *[flat[i] for i in pos])
        for i, t in zip(pos, outs):
            flat[i] = t
        unit.pending_backward += 1
        return tree_unflatten(flat, spec)

    def post_forward(self, unit: Unit, output) -> None:
        """Hook the outputs for the pre-backward; free the full parameters (not the root's)."""
        if is_recomputing():
            if unit.reshard_after_forward and unit is not self.root:
                unit.reshard(after_forward=True)
            return
        if unit is self.root:  # no gather follows in this forward: free the one held
            unit._release_held(self.streams)
        if not torch.is_grad_enabled():
            unit.reshard()
            if unit is self.root:  # evaluation ends: drop gathers prefetched for nothing
                for u in self.units:
                    u.reshard()
                self.checks.settle()
            return
        ref, uref = weakref.ref(self), weakref.ref(unit)

        def hook(_grad, ref=ref, uref=uref):
            st, u = ref(), uref()
            if st is not None and u is not None:
                st.pre_backward(u)

        for t in _tensors_in(output):
            if t.requires_grad:
                t.register_hook(hook)
        if unit.reshard_after_forward and unit is not self.root:
            unit.reshard(after_forward=True)

    # -- backward -----------------------------------------------------------------------------

    def pre_backward(self, unit: Unit) -> None:
        """The first gradient of ``unit``'s outputs: gather it again, prefetch the unit before it."""
        # FORWARD: the first backward after the forward. IDLE or REDUCED: another backward pass
        # through a graph that is still alive (retain_graph, or two forwards and two backwards):
        # gather again. BACKWARD: already gathered in this pass.
        if unit.training_state is TrainingState.BACKWARD:
            return
        self.ensure_finish_queued()
        unit.training_state = TrainingState.BACKWARD
        unit.wait_unshard()
        for prev in self.backward_prefetch(unit):
            if prev.training_state is TrainingState.FORWARD:
                prev.unshard()

    def post_backward(self, unit: Unit) -> None:
        """Free the unit's parameters and start reducing its gradients; the reduce-scatter runs
        while the next unit computes its backward, and finishes when that unit's starts."""
        if unit.training_state is TrainingState.REDUCED:
            return
        if unit.reshard_after_backward:
            unit.reshard()  # the parameters are no longer needed: free them before the reduce buffers
        if unit.grad_sync.syncs:
            self.finish_pending_reduce()
            self.pending_reduce = unit.start_reduce()
            if self.pending_reduce is None:  # on the chunks (one rank): final now (See [Note: The host step])
                grads_landed(unit, self.streams, "compute")
            if unit.grad_sync is GradSync.HELD:
                unit.grad_sync = GradSync.SYNC
        else:
            unit.accumulate_grads()  # in the reduce dtype, if wider
            unit.grad_sync = GradSync.ACCUMULATED  # full gradients wait for the next synced backward
        unit.training_state = TrainingState.REDUCED

    def add_on_host(self) -> None:
        """Wait once for the copies to the host (offloaded gradients are in host memory before
        the optimizer reads them), then add those that accumulate into existing shards' gradients."""
        wait_host_copies()
        for olds, news in self.host_adds:
            torch._foreach_add_(olds, news)
        self.host_adds.clear()

    def finish_pending_reduce(self) -> None:
        if self.pending_reduce is not None:
            pending, self.pending_reduce = self.pending_reduce, None
            pending.finish()
            post = "reduce" if pending.unit.layout.replicate is None else "all_reduce"
            grads_landed(pending.unit, self.streams, post)  # See [Note: The host step]

    def ensure_finish_queued(self) -> None:
        """Make sure `finish_backward` runs when the current backward pass ends."""
        if not self.callback_queued:
            Variable._execution_engine.queue_callback(self.finish_backward)
            self.callback_queued = True

    def finish_backward(self) -> None:
        """End of the backward pass: reduce what is left, free everything, reset for the next step."""
        for unit in reversed(self.units):
            ran = unit.training_state in (TrainingState.FORWARD, TrainingState.BACKWARD)
            if ran or unit.grad_sync is GradSync.HELD:  # incl. gradients left by no_sync steps
                unit.training_state = TrainingState.BACKWARD
                self.post_backward(unit)
            if unit.reshard_after_backward or unit.shard_state is not ShardState.UNSHARDED:
                unit.reshard()  # and prefetched gathers nothing used
        self.finish_pending_reduce()
        self.streams.after("compute", "reduce")  # the gradient shards are written
        if any(u.layout.replicate is not None for u in self.units):  # (with replicas, on the all-reduce stream)
            self.streams.after("compute", "all_reduce")
        for name, _ in self.reduced_held:
            self.streams.note("free", name, "compute")
        self.reduced_held.clear()
        if self.outputs_held:  # allocated on the reduce stream: it waits for the all-reduce stream's uses
            self.streams.after("reduce", "all_reduce")
            for name, buffer in self.outputs_held:
                release(self.streams, name, "reduce", buffer)
            self.outputs_held.clear()
        backward_ended(self.units)  # the host shards' steps in flight: joined
        for unit in self.units if HOOKS.trace is not None else ():  # compute reads the shards' gradients next
            self.streams.note("use", f"{unit.name}:grad-shards", "compute")  # (the optimizer)
            self.streams.note("use", unit.tail_name, "compute")  # (the step's checks)
        for unit in self.units:
            unit.training_state = TrainingState.IDLE
            unit.pending_backward = 0
            if unit.grad_sync is GradSync.SYNC_AT_END:
                unit.grad_sync = GradSync.SYNC
        self.callback_queued = False
        _IN_FLIGHT.discard(self)
        self.add_on_host()
        self.checks.settle_later()  # read at the next root forward (See [Note: Divergence detection])


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, unit: Unit, *tensors: torch.Tensor):
        ctx.unit = weakref.ref(unit)
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        unit: Unit | None = ctx.unit()
        if unit is None:
            return (None, *grads)
        unit.pending_backward -= 1
        if unit.pending_backward == 0 and unit.grad_sync is not GradSync.SYNC_AT_END:
            cast(RootState, unit.root_state).post_backward(unit)
        return (None, *grads)


def post_forward(module: nn.Module, args: tuple, kwargs: dict, output):
    """The module's forward hook: the root state's post-forward for the module's unit."""
    unit = cast(Unit, module._memfit_unit)
    cast(RootState, unit.root_state).post_forward(unit, output)


def _tensors_in(obj) -> list[torch.Tensor]:
    """Tensors in nested tuples, lists, mappings (HF ModelOutput included) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors_in(x)]
    if isinstance(obj, Mapping):
        return [t for x in obj.values() for t in _tensors_in(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors_in(getattr(obj, f.name))]
    return []
