"""A sharded unit as the modules below it see it (its parameter, the step checks), as a
protocol: they name no module that imports them (no import cycle, type-only imports counted).
memfit._shard._unit.Unit is the one kind; the root state its units share: _root_ref.py."""

from __future__ import annotations

from typing import Protocol


class UnitRef(Protocol):
    """A sharded unit as its parameters and the step checks see it."""

    @property
    def index(self) -> int: ...  # position in the root's list of units

    @property
    def name(self) -> str: ...
