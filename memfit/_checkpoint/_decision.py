"""`memfit.Decision`: how one block is treated in a training step, as a value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from torch import nn

from memfit._checkpoint._module import apply_activation_checkpointing, checkpoint_module, remove_checkpointing
from memfit._checkpoint._offload import Offload


class DecisionKind(str, Enum):
    """What is kept of a block's activations between its forward and its backward: the
    planner's choices, cheapest in time first. A ``str``: each member equals its value
    (``DecisionKind.FULL == "full"``), prints and serialises as it (plan JSON, the CLI)."""

    KEEP = "keep"  # every activation the block's backward needs stays: no checkpointing
    SELECTIVE = "selective"  # the block's inputs and the outputs the `save` rule selects; the rest recomputed
    FULL = "full"  # only the block's inputs; everything else recomputed in backward
    OFFLOAD = "offload"  # as FULL, with the inputs moved off the device (disk or host) until backward

    __str__ = str.__str__  # "full", not "DecisionKind.FULL"
    __format__ = str.__format__  # type: ignore[assignment]  # str's, as __str__

    @classmethod
    def parse(cls, name: str | DecisionKind) -> DecisionKind:
        """The kind ``name`` spells; ``"none"`` (the CLI's old spelling of ``"keep"``) is ``KEEP``."""
        if name == "none":
            return cls.KEEP
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"memfit.Decision: unknown kind {name!r}; choose from {KINDS}") from None


KINDS = tuple(k.value for k in DecisionKind)  # the kinds' names, in DecisionKind's order


@dataclass(frozen=True)
class Decision:
    """How a block is checkpointed: the one value the planner, ``memfit bench`` and
    ``memfit train`` choose and apply.

    Fields:
        kind: a :class:`DecisionKind` or its name: ``"keep"`` (store its activations: no checkpointing), ``"selective"``
            (recompute, keeping the outputs that ``save`` selects), ``"full"`` (recompute
            everything; only the block's inputs are kept) or ``"offload"`` (recompute; the
            inputs wait for backward where ``offload`` says).
        save: the selective rule (``"linear"``, ``"matmul"``, ``"all"`` or a callable(op) ->
            bool); only for ``"selective"``.
        offload: ``"disk"``, ``"cpu"`` or a :class:`memfit.Offload`; only for ``"offload"``.

    ``Decision.parse("full")`` builds one from its name (``"none"`` is ``"keep"``).
    """

    kind: DecisionKind
    save: str | Callable | None = None
    offload: str | Offload | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"memfit.Decision: unknown kind {self.kind!r}; choose from {KINDS}")
        object.__setattr__(self, "kind", DecisionKind(self.kind))
        if self.kind == "selective" and self.save is None:
            object.__setattr__(self, "save", "linear")
        if self.kind == "offload" and self.offload is None:
            object.__setattr__(self, "offload", "disk")
        if self.save is not None and self.kind != "selective":
            raise ValueError(f"memfit.Decision: save= is only for kind 'selective', not {self.kind.value!r}")
        if self.offload is not None and self.kind != "offload":
            raise ValueError(f"memfit.Decision: offload= is only for kind 'offload', not {self.kind.value!r}")

    @classmethod
    def parse(cls, spec: str | Decision, **options) -> Decision:
        """A Decision from its name (``"keep"``/``"none"``, ``"selective"``, ``"full"``,
        ``"offload"``), with the options that kind takes; a Decision is returned as is."""
        if isinstance(spec, Decision):
            return spec
        kind = DecisionKind.parse(spec)
        wanted = {"selective": ("save",), "offload": ("offload",)}.get(kind, ())
        return cls(kind, **{k: v for k, v in options.items() if k in wanted and v is not None})

    @property
    def checkpointed(self) -> bool:
        return self.kind != "keep"

    def _options(self) -> dict:
        return {"save": self.save, "offload": self.offload}

    def apply(self, module: nn.Module, *, name: str | None = None) -> nn.Module:
        """Treat ``module`` as decided, in place, replacing any checkpointing it had."""
        remove_checkpointing(module)
        if self.checkpointed:
            checkpoint_module(module, name=name, **self._options())
        return module

    def apply_to(self, model: nn.Module, policy) -> list[str]:
        """Apply this decision to the submodules of ``model`` that ``policy`` selects (see
        :func:`memfit.apply_activation_checkpointing`); returns their paths."""
        if not self.checkpointed:
            return []
        return apply_activation_checkpointing(model, policy, **self._options())

    def __str__(self) -> str:
        return self.kind
