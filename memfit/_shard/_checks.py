"""What a sharded step checks on the host, batched into one device-to-host transfer per step:
ranks that diverged, and parameters no rank produced a gradient for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memfit._instrument import HOOKS
from memfit._shard._device import host_read

if TYPE_CHECKING:
    from memfit._shard._param import ShardedParam
    from memfit._shard._unit import Unit

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


class StepChecks:
    """The device-side values a step checks on the host, and the one transfer that reads them."""

    def __init__(self, rank: int, eager: bool = False) -> None:
        self.rank = rank
        self.debug = HOOKS.debug_collectives or eager  # settle at once: debugging, or no step to wait for
        self._gathers: list[tuple[Unit, torch.Tensor]] = []  # (unit, the W gathered indices)
        self._reduces: list[tuple[Unit, list[ShardedParam], torch.Tensor, bool]] = []  # flags + check sums
        self._fresh: dict[ShardedParam, torch.Tensor | None] = {}  # gradients this step created: None if unused

    def gathered(self, unit: Unit, ids: torch.Tensor) -> None:
        """Check later that every rank sent ``unit``'s index (``ids``: one value per rank)."""
        self._gathers.append((unit, ids))
        if self.debug:
            self.settle()

    def reduced(self, unit: Unit, params: list[ShardedParam], tail: torch.Tensor, exact: bool) -> None:
        """``tail``: the reduced has-gradient flags of ``params``, then the two check sums (after
        the division by W: i and i*i), checked when ``exact``."""
        self._reduces.append((unit, params, tail, exact))
        if self.debug:
            self.settle()

    def fresh_grad(self, sp: ShardedParam) -> None:
        """``sp.sharded.grad`` was None before this step's reduce gave it one."""
        self._fresh[sp] = sp.sharded.grad

    def settle(self) -> None:
        """Read everything recorded in one transfer; raise on divergence; drop unused gradients."""
        if not self._gathers and not self._reduces:
            return
        parts = [ids.reshape(-1) for _, ids in self._gathers] + [tail for *_, tail, _ in self._reduces]
        values = _read(parts)
        if values is None:  # the meta test device holds no values (See [Note: Devices and the meta test device])
            self._clear()
            return
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

    def _clear(self) -> None:
        self._gathers, self._reduces, self._fresh = [], [], {}


def _read(parts: list[torch.Tensor]) -> list[float] | None:
    """The values of ``parts``, concatenated, in one transfer (the step's one host sync); a
    few ops whatever the number of parts: one concatenation and one cast per dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(parts):
        by_dtype.setdefault(t.dtype, []).append(i)
    groups = list(by_dtype.values())
    flat = [torch.cat([parts[i] for i in g]).to(torch.float64) for g in groups]
    values = host_read(torch.cat(flat) if len(flat) > 1 else flat[0])
    if values is None:
        return None
    out: list[list[float]] = [[] for _ in parts]
    pos = 0
    for g in groups:
        for i in g:
            out[i] = values[pos : pos + parts[i].numel()]
            pos += parts[i].numel()
    return [v for part in out for v in part]
