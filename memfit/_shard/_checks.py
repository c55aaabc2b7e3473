"""What a sharded step checks on the host, batched into one device-to-host transfer per step:
ranks that diverged, and parameters no rank produced a gradient for.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memfit._instrument import HOOKS
from memfit._shard._device import host_empty, host_read

if TYPE_CHECKING:
    from memfit._shard._param import ShardedParam
    from memfit._shard._roles import UnitRef

# [Note: Divergence detection]
# Every collective carries the unit's index: the all-gather slot ends with i = index mod 256
# (exact in every float dtype down to bf16, and a byte on a byte wire), the reduce-scatter
# slot with i = index mod 64 and i * i (their sums over ranks are W*i and W*i*i only if every
# rank reduced the same unit; checked for fp32/fp64 gradients, where those sums are exact).
# Reading those values on the host would stop it at every unit until the device drains, so
# they stay on the device: each unit's gathered indices and reduced check sums are kept
# (views, no copies), and read together with the has-gradient flags in one transfer at the
# end of backward (or at the end of a forward without grad). Ranks that ran different units
# then fail there with an error naming the rank and the unit. With the environment variable
# MEMFIT_DEBUG_COLLECTIVES=1 every collective is checked as soon as it finishes (one host sync
# each): the error then points at the first collective that went wrong.
# What the transport does on a mismatch: NCCL checks nothing. Ranks that call collectives of
# different sizes exchange min-sized garbage or wait for each other forever (until the
# process group's timeout, or NCCL's watchdog, aborts); ranks that call the same sizes in a
# different order exchange wrong data silently. gloo likewise trusts the sizes it is given.
# The index in every slot is what turns "silently wrong" into an error; a hang still ends with
# the timeout error of memfit's collectives, which names the unit and the rank.
#
# The read itself is off the backward (FSDP2's backward never waits for the host either): at
# the end of backward the values are packed on the device and copied to pinned host memory
# without blocking, and the host reads them at the next root forward if that copy has landed
# (its event queried, not waited for: no host sync), else at the one after, which waits for it
# only if the device is still more than a step behind (a host that far ahead was already
# waiting on something else); a divergence then fails within two steps, naming the unit and
# the rank as before. With one data-parallel rank nothing is recorded (no rank to diverge
# from; See [Note: One rank computes on its shards]).
# A parameter that got no gradient on this rank: whether another rank gave it one (then its
# shard keeps the sum) or none did (then its .grad goes back to None, as under DDP and in one
# process, so that the optimizer skips it instead of stepping on a zero) is only known from the
# flags. The decision is not taken in backward: the gradient stays as reduced (zero where no
# rank had one) and the flags are read off the backward as in any step. It is settled before
# the optimizer step, by a torch optimizer step pre-hook (global, installed once): the step of
# an optimizer holding an undecided parameter first finishes the reads in flight (that step's
# one host wait, outside backward), then sets to None the gradients no rank had in any backward
# since they were created (accumulation included). A root forward that finds every read landed
# settles them there too, without waiting (the same arithmetic: a gradient created again later
# holds the same sum). Until then the .grad of a parameter no rank used is a zero tensor; an
# optimizer outside torch.optim (no step hooks) steps on those zeros. Steps in which this rank
# has every gradient decide nothing and never wait.

_UNDECIDED: weakref.WeakSet[StepChecks] = weakref.WeakSet()  # process-wide: torch's step hook is global
_step_hook: Any = None  # process-wide: torch's optimizer step pre-hook, installed once


def _settle_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: settle the gradients of ``optimizer``'s parameters that no
    rank may have had (See [Note: Divergence detection])."""
    for checks in list(_UNDECIDED):
        held = {id(sp.sharded) for sp in checks.undecided}
        if held and any(id(p) in held for group in optimizer.param_groups for p in group["params"]):  # most steps: none
            checks.settle()


class StepChecks:
    """The device-side values a step checks on the host, and the one transfer that reads them."""

    def __init__(self, rank: int, eager: bool = False) -> None:
        self.rank = rank
        self.debug = HOOKS.debug_collectives or eager  # settle at once: debugging, or no step to wait for
        self._gathers: list[tuple[UnitRef, torch.Tensor]] = []  # (unit, the W gathered indices)
        self._reduces: list[tuple[UnitRef, list[ShardedParam], torch.Tensor, bool]] = []  # flags + check sums
        self._fresh: dict[ShardedParam, torch.Tensor | None] = {}  # gradients this step created: None if unused
        self._lacking: set[ShardedParam] = set()  # parameters with no gradient on this rank this step
        # gradients this rank had none for in any backward since they were created, which no read
        # has yet found another rank to have (weakly: zero_grad drops them)
        self.undecided: dict[ShardedParam, weakref.ref] = {}
        self._blind = False  # a read without values (the meta test device): decide nothing
        # Reads started at the end of backwards, oldest first: (gathers, reduces, host values
        # or the meta tensor, the copy's event or None, the undecided gradients it covers)
        self._started: list[tuple[list, list, torch.Tensor, Any, dict]] = []

    def gathered(self, unit: UnitRef, ids: torch.Tensor) -> None:
        """Check later that every rank sent ``unit``'s index (``ids``: one value per rank)."""
        self._gathers.append((unit, ids))
        if self.debug:
            self.settle()

    def reduced(
        self, unit: UnitRef, params: list[ShardedParam], tail: torch.Tensor, exact: bool, have: tuple[bool, ...] = ()
    ) -> None:
        """``tail``: the reduced has-gradient flags of ``params``, then the two check sums (after
        the division by W: i and i*i), checked when ``exact``; ``have``: which of ``params``
        had a gradient on this rank."""
        self._reduces.append((unit, params, tail, exact))
        for sp, h in zip(params, have):
            if h:
                self.undecided.pop(sp, None)  # this rank has one: kept, whatever the others had
            else:
                self._lacking.add(sp)
        if self.debug:
            self.settle()

    def lacks(self, params: list[ShardedParam]) -> bool:
        """Whether this rank had no gradient for one of ``params`` in this step (so far)."""
        return any(sp in self._lacking for sp in params)

    def fresh_grad(self, sp: ShardedParam) -> None:
        """``sp.sharded.grad`` was None before this step's reduce gave it one."""
        self._fresh[sp] = sp.sharded.grad

    def moved_grad(self, sp: ShardedParam, old: torch.Tensor) -> None:
        """``sp.sharded.grad``, ``old`` until now, is another tensor of the same values (the disk
        tier moved it into its file: See [Note: Gradients on the disk tier])."""
        if self._fresh.get(sp) is old:
            self._fresh[sp] = sp.sharded.grad

    def settle(self, wait: bool = True) -> None:
        """Read everything recorded (and the reads started earlier) now, in one transfer; raise
        on divergence; drop unused gradients. ``wait=False`` (the root's forward): leave the
        last started read in flight if its copy has not landed yet (See [Note: Divergence detection])."""
        self._finish_started(keep=0 if wait else 1)
        if self._gathers or self._reduces:
            parts = [ids.reshape(-1) for _, ids in self._gathers] + [tail for *_, tail, _ in self._reduces]
            self._mark_used(self._check(_read(_packed(parts), parts)), self.undecided)
        if not self._started:
            self._decide()

    def settle_later(self) -> None:
        """The end of backward: start reading what was recorded, without waiting; the next
        :meth:`settle` finishes the read (at once when debugging; See [Note: Divergence detection])."""
        self._finish_started(keep=1)  # at most two reads in flight
        if not self._gathers and not self._reduces:
            return
        if self.debug:
            return self.settle()
        for sp, grad in self._fresh.items():
            if sp in self._lacking and grad is not None:
                self.undecided[sp] = weakref.ref(grad)  # settled before the optimizer step
        if self.undecided:
            _watch(self)
        parts = [ids.reshape(-1) for _, ids in self._gathers] + [tail for *_, tail, _ in self._reduces]
        flat = _packed(parts)
        if flat.device.type in ("cpu", "meta"):  # nothing crosses (the meta test device: nothing to read)
            host, event = flat, None
        else:  # pragma: no cover (needs a GPU)
            host = host_empty(flat.shape, flat.dtype)
            host.copy_(flat, non_blocking=True)
            event = torch.Event(device=flat.device)
            event.record()
        # the read needs the parts' sizes and dtypes only: a tail viewing a reduce output would
        # hold the whole output (the gradient shards, after zero_grad) until the copy lands
        reduces = [(u, params, _stand_in(tail), exact) for u, params, tail, exact in self._reduces]
        self._started.append((self._gathers, reduces, host, event, dict(self.undecided)))
        self._gathers, self._reduces, self._fresh, self._lacking = [], [], {}, set()

    def _finish_started(self, keep: int = 0) -> None:
        """Read and check the values :meth:`settle_later` started copying, oldest first; of the
        last ``keep`` of them, only those whose copy has landed (an event's query does not
        block). The host waits for the others' copies (queued a step or more ago)."""
        while self._started:
            gathers, reduces, host, event, covers = self._started[0]
            landed = event is None or event.query()
            if not landed and len(self._started) <= keep:
                return  # still in flight: read at a later settle
            self._started.pop(0)
            if not landed:
                event.synchronize()
            self._mark_used(self._read_started(gathers, reduces, host), covers)

    def _mark_used(self, used: frozenset | None, covers: dict[ShardedParam, weakref.ref]) -> None:
        """``used`` (None: a read without values) had a gradient on some rank: kept, where the
        gradient is the one that read covered."""
        if used is None:
            self._blind = True
            return
        for sp in used:
            if sp in covers and self.undecided.get(sp) is covers[sp]:
                del self.undecided[sp]

    def _decide(self) -> None:
        """Every read is done: the undecided gradients no rank had go back to None."""
        for sp, ref in self.undecided.items():
            if not self._blind and ref() is not None and sp.sharded.grad is ref():
                sp.sharded.grad = None  # no rank produced one since it was created
        self.undecided.clear()
        self._blind = False
        _UNDECIDED.discard(self)

    def _read_started(self, gathers: list, reduces: list, host: torch.Tensor) -> frozenset | None:
        mine = (self._gathers, self._reduces, self._fresh, self._lacking)
        self._gathers, self._reduces, self._fresh, self._lacking = gathers, reduces, {}, set()
        parts = [ids.reshape(-1) for _, ids in gathers] + [tail for *_, tail, _ in reduces]
        try:
            return self._check(_read(host, parts))
        finally:
            self._gathers, self._reduces, self._fresh, self._lacking = mine

    def _check(self, values: list[float] | None) -> frozenset | None:
        """Check ``values`` (the recorded parts' values, None on the meta test device) and clear;
        the recorded parameters some rank had a gradient for (None: no values)."""
        if values is None:  # the meta test device holds no values (See [Note: Devices and the meta test device])
            self._clear()
            return None
        pos = 0
        for unit, ids in self._gathers:
            got = values[pos : pos + ids.numel()]
            pos += ids.numel()
            if any(v != unit.index % 256 for v in got):
                self._clear()
                raise RuntimeError(
                    f"memfit sharding: rank {self.rank} gathered unit '{unit.name}' (#{unit.index}) while the ranks "
                    f"sent units {[int(v) for v in got]}: ranks diverged (one skipped or reordered a forward)."
                )
        used: set[ShardedParam] = set()
        for unit, params, tail, exact in self._reduces:
            flags, checks = values[pos : pos + len(params)], values[pos + len(params) : pos + tail.numel()]
            pos += tail.numel()
            i = unit.index % 64
            if exact and checks != [i, i * i]:
                self._clear()
                raise RuntimeError(
                    f"memfit sharding: rank {self.rank} reduced the gradients of unit '{unit.name}' (#{unit.index}) "
                    "while other ranks reduced another unit: ranks diverged (one skipped or reordered a forward "
                    "or backward)."
                )
            used.update(sp for sp, f in zip(params, flags) if f > 0)
        for sp, grad in self._fresh.items():
            if sp not in used and sp.sharded.grad is grad:
                sp.sharded.grad = None  # no rank produced one: as in single-process training
        self._clear()
        return frozenset(used)

    def _clear(self) -> None:
        self._gathers, self._reduces, self._fresh, self._lacking = [], [], {}, set()


def _watch(checks: StepChecks) -> None:
    """Have the next optimizer step over ``checks``' undecided gradients settle them first."""
    global _step_hook  # noqa: PLW0603 (installed once per process)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_settle_before_step)
    _UNDECIDED.add(checks)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype holding no memory (the meta device)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _groups(parts: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``parts``, grouped by dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(parts):
        by_dtype.setdefault(t.dtype, []).append(i)
    return list(by_dtype.values())


def _packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` in one fp64 tensor, by dtype: a few ops whatever the number of parts (one
    concatenation and one cast per dtype)."""
    flat = [torch.cat([parts[i] for i in g]).to(torch.float64) for g in _groups(parts)]
    return torch.cat(flat) if len(flat) > 1 else flat[0]


def _read(packed: torch.Tensor, parts: list[torch.Tensor]) -> list[float] | None:
    """The values of ``parts`` from ``packed`` (:func:`_packed`), in ``parts``' order, in one
    transfer (the step's one host read)."""
    values = host_read(packed)
    if values is None:
        return None
    groups = _groups(parts)
    out: list[list[float]] = [[] for _ in parts]
    pos = 0
    for g in groups:
        for i in g:
            out[i] = values[pos : pos + parts[i].numel()]
            pos += parts[i].numel()
    return [v for part in out for v in part]
