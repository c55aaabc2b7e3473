"""The state shared under a sharded root as its units see it, as a protocol: the unit names
no module that imports it (no import cycle, type-only imports counted).
memfit._shard._runtime.RootState is the one kind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from memfit._shard._checks import StepChecks
    from memfit._shard._streams import Streams


class RootStateRef(Protocol):
    """The state shared under a root, as its units see it."""

    @property
    def root(self) -> object: ...  # the root's unit

    @property
    def streams(self) -> Streams: ...

    @property
    def checks(self) -> StepChecks: ...

    gather_held: tuple[str, torch.Tensor, Any] | None
    reduced_held: list[tuple[str, torch.Tensor]]
    outputs_held: list[tuple[str, torch.Tensor]]
    forward_order: list[Any]  # the units in forward order, recorded in the first step (the host step reads it)
    host_adds: list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # offloaded accumulations, added after backward

    def add_on_host(self) -> None: ...  # run host_adds after the one wait at the end of backward
