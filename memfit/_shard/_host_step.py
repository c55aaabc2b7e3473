"""`memfit.host_optimizer`: the optimizer step over shards in host memory at the CPU's speed,
per unit, while the rest of backward runs (See [Note: The host step])."""

from __future__ import annotations

import concurrent.futures
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memfit._instrument import HOOKS
from memfit._shard._device import host_empty
from memfit._shard._disk_units import DiskUnits, disk_units_of
from memfit._shard._optim_state import install_optimizer_state_hooks, localize_loaded_state
from memfit._shard._streams import Streams
from memfit._shard._unit import Unit, units_of

__all__ = ["HostStep", "host_optimizer"]

# [Note: The host step]
# With the shards in host memory (offload="cpu", or any sharded model computing on the CPU)
# the optimizer steps on the CPU, and torch's CPU default for Adam, AdamW and SGD is the
# for-loop implementation: on 50M parameters about 6x slower than the fused one
# (benchmarks/results/offload_tiers_cpu.md). memfit.host_optimizer(model, optimizer) does two things:
# - It turns the groups whose parameters are all in host memory to torch's fused CPU
#   implementation (fused=True, foreach=False) where the optimizer has one (Adam, AdamW, SGD,
#   Adagrad) and the group allows it (not differentiable, not capturable); every other
#   optimizer or group steps as given. Either way it says so once, in a warning. Fused is
#   other arithmetic than the for-loop: the exact reference is the same optimizer built with
#   fused=True, stepped after backward.
# - It steps each unit's host shards as soon as their gradients are final, on one worker
#   thread, while the main thread runs the rest of backward (on an accelerator: while the device
#   computes the earlier units' backward). Final means: reduced into the shards (or, with one
#   rank computing on its chunks, accumulated by autograd) in the backward that ends the step.
#   The worker first waits for the event recorded after the gradients' copy to the host (a host
#   wait on a worker thread: the main thread never blocks in backward); the end of backward
#   joins it, so everything after backward (clipping, state_dict, the next forward's gathers)
#   sees stepped shards. The step of a subset of the parameters is the optimizer's own step
#   with each group's list narrowed to that unit's parameters: exact (bitwise) against one step
#   over all of them, because every torch optimizer but LBFGS updates a parameter from its own
#   gradient and state only (fused and foreach kernels too: they loop over the tensors). The
#   user's optimizer.step() then steps what is left (parameters on the device, ignored ones,
#   units stepped nowhere else), with the optimizer's hooks, once.
# The rule for what may step in backward:
# - accumulation: backward n since the last optimizer.step() steps in backward when
#   n >= accumulate (the last micro-batch); with no_sync, the backwards inside no_sync reduce
#   nothing and so step nothing. A unit whose gradients are reduced again after it stepped in
#   this step (more backwards than `accumulate`, a second backward through a retained graph)
#   is refused: its step already read the gradients.
# - clipping needs the global norm over every unit and rank, known only once backward ends:
#   with max_norm the steps do not run in backward; optimizer.step() clips (memfit's
#   clip_grad_norm_, the norm in `last_norm`) and then steps every unit, fused (the disk tier's
#   units one at a time, before the rest: See [Note: The disk tier]). A call of
#   memfit.clip_grad_norm_ after a step in backward is refused (the clip would come too late).
# - overlap=False: never in backward (a GradScaler, which unscales between backward and step,
#   or an optimizer whose update reads more than one parameter).
# [Note: What defers a host step]
# A unit whose gradients are final still waits for optimizer.step() (the step after backward,
# exact as ever) where stepping it in backward could read other gradients than the reference:
# - offloaded gradients that accumulate into existing host gradients are added once backward
#   ends (RootState.add_on_host): while any are pending, the unit would step without them;
# - a parameter this rank has no gradient for: whether any rank had one (a gradient, or None)
#   is known only once the step's flags are read (See [Note: Divergence detection]);
# - a GradScaler (the optimizer carries grad_scale or found_inf): it unscales after backward;
# - an optimizer from outside torch.optim: its update may read more than one parameter (LAMB).
# Gradients written after their unit stepped (torch's clip_grad_norm_, a hook) are refused at
# optimizer.step() by their version counters: loud, as the step already ran.
# On an accelerator the step also packs the stepped shards of the next forward's first units
# (STAGED) into pinned memory laid out as their send slots (Unit.staged), so that their gathers
# copy across at once instead of packing on the host first; later units' packs overlap the
# compute of the units before them. A unit whose shards changed since (a load) packs again.
# What cannot be tested here (no GPU): the worker's event wait and its overlap with device
# compute; the CPU suite runs the worker for real (gloo parity, bitwise) and, when the streams
# are traced, on the calling thread so that the trace is deterministic (tests/unit/test_stream_rules.py).

STAGED = 2  # units packed ahead into pinned memory for the next forward: its first ones

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


class HostStep:
    """What :func:`host_optimizer` attaches to an optimizer (``optimizer._memfit_host_step``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        accumulate: int,
        max_norm: float | None,
        overlap: bool,
        disk: tuple[str, set[nn.Module] | None] | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.accumulate, self.max_norm = accumulate, max_norm
        self.in_backward = overlap and max_norm is None  # See [Note: The host step]
        self.last_norm: float | None = None  # the norm optimizer.step() clipped by (max_norm)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.params: dict[Unit, list[nn.Parameter]] = {}  # each unit's host shards this optimizer steps
        for unit in units_of(model):
            mine = [sp.sharded for sp in unit.params if id(sp.sharded) in in_optimizer]
            if mine and all(p.device.type == "cpu" for p in mine):
                self.params[unit] = mine
                unit.host_step = self
        self.backwards = 0  # backwards ended since the last optimizer.step()
        self.stepped: set[Unit] = set()  # units stepped in backward since the last optimizer.step()
        self.steps_in_backward = 0  # unit steps run in backward, in all (tests and benchmarks read it)
        self.read: dict[Unit, list[tuple[torch.Tensor, int]]] = {}  # gradients each stepped unit read, versions
        self.staged_units = 0  # units packed ahead for their next gather, in all
        self._pending: list[tuple[concurrent.futures.Future | None, object]] = []  # (work, host event)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._raw = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)  # without the hooks
        self._user_step = optimizer.step
        self.how = _use_fused(optimizer)
        self.disk: DiskUnits | None = None  # See [Note: The disk tier]
        if disk is not None:
            directory, modules = disk
            chosen = [u for u in self.params if modules is None or u.module in modules]
            self.disk = DiskUnits(directory, chosen, optimizer, self.params)

    # -- in backward ------------------------------------------------------------------------

    def landed(self, unit: Unit, streams: Streams, stream: str) -> None:
        """``unit``'s gradients are final on ``stream`` (its reduce or, one rank, compute):
        step its shards now, on the worker, if this backward ends the step."""
        if unit not in self.params:
            return
        if not self.in_backward or self.backwards + 1 < self.accumulate or self._defer(unit):
            if self.disk is not None:  # written behind, read for the step (See [Note: Gradients on the disk tier])
                self._run(self._write_behind, unit, streams, streams.record(stream))
            return  # optimizer.step() steps it, after backward (See [Note: What defers a host step])
        if unit in self.stepped:
            raise RuntimeError(
                f"memfit.host_optimizer: unit '{unit.name}' was reduced again after its optimizer step ran in "
                f"backward (accumulate={self.accumulate}, {self.backwards + 1} backwards since the last "
                "optimizer.step()); call optimizer.step() after every accumulate-th backward, or pass "
                "accumulate= the number of backwards per step"
            )
        self.stepped.add(unit)
        self.steps_in_backward += 1
        self._run(self._step, unit, streams, streams.record(stream))

    def _run(self, work, unit: Unit, streams: Streams, ready: object) -> None:
        """``work(unit, ready)`` on the worker thread; joined at the end of backward."""
        if HOOKS.trace is not None:  # traced: on this thread, so that the log is deterministic
            # the main thread's earlier host work on these shards (the last step, zero_grad)
            # precedes in program order: traced as a wait for compute, never waited for
            HOOKS.trace.log.append(("wait", "host", streams.record("compute")))
            work(unit, ready)
            self._pending.append((None, self._done()))
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memfit-host-step")
        self._pending.append((self._worker.submit(work, unit, ready), None))

    def _write_behind(self, unit: Unit, ready: object) -> None:
        """The disk tier: ``unit``'s gradients, final after ``ready``, into its file and written
        back; its step comes later (See [Note: Gradients on the disk tier])."""
        if hasattr(ready, "synchronize"):  # pragma: no cover (a CUDA event: needs a GPU)
            ready.synchronize()
        assert self.disk is not None
        self.disk.grads_landed(unit, stepping=False)

    def _defer(self, unit: Unit) -> bool:
        """Whether ``unit`` must wait for optimizer.step() instead of stepping in backward
        (See [Note: What defers a host step])."""
        state = unit.root_state
        if state is not None and state.host_adds:  # accumulations still to be added on the host
            return True
        if state is not None and state.checks.lacks(unit.params):  # a gradient no rank may have had
            return True
        opt = self.optimizer
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return True  # a GradScaler unscales between backward and step
        return not type(opt).__module__.startswith("torch.optim")  # per-parameter updates: torch's own

    def _step(self, unit: Unit, ready: object) -> None:
        """The optimizer's step over ``unit``'s host shards, after the event ``ready``."""
        if hasattr(ready, "synchronize"):  # pragma: no cover (a CUDA event: needs a GPU)
            ready.synchronize()
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("wait", "host", ready))
            HOOKS.trace.log.append(("use", f"{unit.name}:grad-shards", "host"))
        if self.disk is not None:  # See [Note: Gradients on the disk tier]
            self.disk.grads_landed(unit, stepping=True)
        self._narrowed(self.params[unit], self._raw_step)
        self.read[unit] = [(g, g._version) for g in (p.grad for p in self.params[unit]) if g is not None]
        self._stage(unit)
        if self.disk is not None:
            self.disk.stepped(unit)  # written behind the step

    def _stage(self, unit: Unit) -> None:
        """Accelerators: pack the stepped shards of one of the first units of the next forward
        into pinned memory laid out as its send slot, so that its gather only copies it across."""
        layout = unit._gather_plan
        order = self._first_in_forward(unit)
        if layout is None or layout.device.type == "cpu" or unit not in order:
            return
        staging = host_empty((layout.slot,), layout.wire)
        views = layout.send_views(staging)[:-1]
        torch._foreach_copy_(views, [p.sharded.detach() for p in layout.order])
        unit.staged = (staging, [p.sharded._version for p in layout.order])
        self.staged_units += 1

    def _first_in_forward(self, unit: Unit) -> list[Unit]:
        state = unit.root_state
        order = state.forward_order if state is not None else []
        return [u for u in order if u in self.params][:STAGED]

    def _raw_step(self) -> None:
        with torch.no_grad():
            self._raw(self.optimizer)

    def _done(self) -> object:
        event = object()
        if HOOKS.trace is not None:
            HOOKS.trace.log.append(("record", "host", event))
        return event

    def backward_ended(self) -> None:
        """The end of backward: wait for the steps in flight (their errors surface here)."""
        pending, self._pending = self._pending, []
        for work, event in pending:
            if work is not None:
                work.result()
            if HOOKS.trace is not None and event is not None:
                HOOKS.trace.log.append(("wait", "compute", event))
        self.backwards += 1

    def check_clip(self, unit: Unit) -> None:
        """Refuse clipping gradients that this host step already read in backward."""
        if unit in self.stepped:
            raise RuntimeError(
                f"memfit.clip_grad_norm_: unit '{unit.name}' already stepped in backward (memfit.host_optimizer), "
                "so clipping now comes too late; pass max_norm= to memfit.host_optimizer instead"
            )

    def close(self) -> None:
        """Release what the host step holds beyond the optimizer: the disk tier's files (their
        descriptors; See [Note: The disk tier]) and the worker thread. Idempotent; the disk
        tier's files close at the latest when the optimizer is collected."""
        self.backward_ended_if_pending()
        if self.disk is not None:
            self.disk.close()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    # -- optimizer.step() -------------------------------------------------------------------

    def step(self, closure: Any = None) -> Any:
        """The user's ``optimizer.step()``: clip (max_norm), then step what did not step in backward."""
        self.backward_ended_if_pending()
        self._check_unchanged()
        if self.max_norm is not None:
            from memfit._shard._utils import clip_grad_norm_

            self.last_norm = clip_grad_norm_(self.model, self.max_norm)  # (disk units' a unit at a time)
        done = {id(p) for u in self.stepped for p in self.params[u]}
        try:
            if self.disk is not None:
                self._step_on_disk(self.disk, done)
            rest = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in done]
            out = self._narrowed(rest, lambda: self._user_step(closure) if closure else self._user_step())
            for unit in self.params:  # (those that did not step in backward)
                if unit not in self.stepped:
                    self._stage(unit)
                    if self.disk is not None:
                        self.disk.stepped(unit)
            return out
        finally:
            self.stepped.clear()
            self.read.clear()
            self.backwards = 0

    def _step_on_disk(self, disk: DiskUnits, done: set[int]) -> None:
        """The disk units that did not step in backward, one at a time: read ahead, stepped,
        written back and released before the next, so that one unit's files are resident, not
        the model's (See [Note: The disk tier]); ``done`` gains their parameters."""
        for unit in disk.units:
            if unit in self.stepped:
                continue
            disk.before_step(unit)
            self._narrowed(self.params[unit], self._raw_step)
            self._stage(unit)
            disk.stepped(unit)
            self.stepped.add(unit)
            done.update(id(p) for p in self.params[unit])

    def _check_unchanged(self) -> None:
        """Refuse gradients written after their unit stepped in backward (torch's clip_grad_norm_,
        a step pre-hook, a GradScaler's unscale_): that step read them before the change."""
        changed = sorted(u.name for u, grads in self.read.items() if any(g._version != v for g, v in grads))
        if changed:  # this step is lost: start the next one afresh
            self.read.clear()
            self.stepped.clear()
            self.backwards = 0
            raise RuntimeError(
                f"memfit.host_optimizer: the gradients of unit(s) {changed} changed after those units stepped in "
                "backward (a clip, a GradScaler or a hook between backward and optimizer.step()), so their step "
                "did not see the change; pass max_norm= to memfit.host_optimizer to clip, or overlap=False"
            )

    def backward_ended_if_pending(self) -> None:
        if self._pending:  # a backward that ended outside memfit's callback (should not happen)
            self.backward_ended()

    def _narrowed(self, params: list[nn.Parameter], run) -> Any:
        """``run()`` with each parameter group's list narrowed to ``params``."""
        keep = {id(p) for p in params}
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, saved):
                g["params"] = [p for p in ps if id(p) in keep]
            return run()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps


def _use_fused(optimizer: torch.optim.Optimizer) -> str:
    """Turn the groups of host parameters to the fused CPU implementation where there is one;
    warn once which implementation the host step runs (See [Note: The host step])."""
    name = type(optimizer).__name__
    if type(optimizer) not in _FUSED:  # (a subclass may step otherwise)
        how = f"{name} as given (torch has no fused CPU implementation of it)"
    else:
        turned, kept = 0, 0
        for g in optimizer.param_groups:
            host = all(p.device.type == "cpu" for p in g["params"])
            if host and not g.get("differentiable") and not g.get("capturable"):
                g["fused"], g["foreach"] = True, False
                turned += 1
            elif not g.get("fused"):
                kept += 1
        if turned and not kept:  # every group unscales itself (a group as given needs GradScaler's unscale_)
            optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]  # as torch's fused constructor
        how = f"{name} with fused=True (torch's fused CPU kernels)" if turned else f"{name} as given"
        if kept:
            how += f"; {kept} group(s) as given (parameters off the host, differentiable or capturable)"
    warnings.warn(f"memfit.host_optimizer: the host step runs {how}", stacklevel=4)
    return how


def host_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    accumulate: int = 1,
    max_norm: float | None = None,
    overlap: bool = True,
    disk: str | None = None,
    disk_modules: Iterable[nn.Module] | None = None,
) -> torch.optim.Optimizer:
    """Run ``optimizer``'s step over the sharded ``model``'s host shards at the CPU's speed.

    The groups whose parameters are in host memory (``offload="cpu"``, or a model computing on
    the CPU) use torch's fused CPU implementation where the optimizer has one (Adam, AdamW, SGD,
    Adagrad; others step as given; a warning says which), and each unit's shards step as soon as
    its gradients are on the host, on a worker thread, while the rest of backward runs (See
    [Note: The host step]). Returns ``optimizer`` itself; keep calling ``loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad()`` as before.

    Args:
        model: the sharded model (after ``memfit.shard`` / ``FullyShardedDataParallel``).
        optimizer: built from ``model.parameters()`` after sharding.
        accumulate: backwards per optimizer step (gradient accumulation without ``no_sync``);
            the steps run in the last of them.
        max_norm: clip the gradients by their global norm at ``optimizer.step()`` (memfit
            clips; do not call ``clip_grad_norm_`` yourself); the steps then run after backward.
        overlap: False: never step in backward (with a ``GradScaler``, or an optimizer whose
            update of a parameter reads others').
        disk: a directory on a local disk: the disk tier. The host units' parameter shards,
            gradients and optimizer state live in files there (scratch: unlinked at once,
            nothing survives the process; resume from checkpoints), read ahead of each unit's
            forward, backward and step and written back behind them (See [Note: The disk tier],
            [Note: Gradients on the disk tier]). Refused up front, naming the path and the
            bytes, where the disk has no room. ``optimizer._memfit_host_step.close()`` closes
            the files' descriptors (else they close when the optimizer is collected).
        disk_modules: which sharded modules' units go to disk (default: every host unit).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memfit.host_optimizer: optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("memfit.host_optimizer: LBFGS steps with a closure over every parameter; step it as usual")
    if type(accumulate) is not int or accumulate < 1:
        raise ValueError(f"memfit.host_optimizer: accumulate must be an int >= 1, got {accumulate!r}")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"memfit.host_optimizer: max_norm must be > 0 or None, got {max_norm!r}")
    if getattr(optimizer, "_memfit_host_step", None) is not None:
        raise ValueError(f"memfit.host_optimizer: {type(optimizer).__name__} has a host step already")
    tier = (disk, disk_units_of(model, disk_modules)) if disk is not None else None
    host = HostStep(model, optimizer, accumulate, max_norm, overlap, tier)
    # What the first optimizer.step() would do (memfit's step pre-hook), before the host step
    # creates any state in backward: that state is this rank's already, never cut into rows
    # again (a 0-dim parameter's scalar `step` would become an empty tensor on other ranks)
    localize_loaded_state(optimizer)
    install_optimizer_state_hooks(optimizer)
    optimizer._memfit_host_step = host  # type: ignore[attr-defined]
    # a method of the optimizer, not of the host step: an LR scheduler made later rebinds its
    # function to it; one made before marked its wrapper, and so is ours (it keeps counting)
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer.step = _scheduled(optimizer)  # type: ignore[method-assign]
    else:
        optimizer.step = types.MethodType(_step, optimizer)  # type: ignore[method-assign]
    return optimizer


def _scheduled(optimizer: torch.optim.Optimizer):
    """``optimizer.step`` under :func:`host_optimizer`, where an LR scheduler wrapped it before:
    marked as its wrapper is (the host step calls that wrapper, which records the call)."""

    def step(closure: Any = None) -> Any:
        return _step(optimizer, closure)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def _step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``optimizer.step`` under :func:`host_optimizer`."""
    return optimizer._memfit_host_step.step(closure)  # type: ignore[attr-defined]
