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

    @property
    def spec(self) -> KindSpec:
        """What this kind accepts and how it is applied, traced and priced (see [Note: Decision
        kinds as data])."""
        return SPECS[self]


# [Note: Decision kinds as data]
# Each kind is declared once: its DecisionKind member (the name, cheapest in time first) and its
# KindSpec here, which says what else the library does with it. Decision takes the option the
# spec names (with its default) and refuses the others; memfit train applies the kinds whose
# train_applies is set (--checkpointing's choices, the kinds --auto and --plan plan with, the
# uniform kind memfit plan suggests: all three read TRAIN_KINDS' members through .spec); the
# planner's block profile runs the block under each kind whose traced_as is None and derives the
# others from the kind they name: a kind that moves_input keeps what that kind keeps less the
# block's input, which costs two transfers of it at the device profile's offload bandwidth.
# Adding a kind is this file (a member and its KindSpec; its behaviour in checkpoint_module
# through the option it takes) plus its cases in tests/unit/test_decision.py.
@dataclass(frozen=True)
class KindSpec:
    """What one decision kind accepts and how it is applied, traced and priced."""

    option: str | None = None  # the Decision field it takes ("save", "offload"); None: none
    default: str | None = None  # that field's value when not given
    train_applies: bool = True  # memfit train applies it (--checkpointing, --plan, --auto)
    traced_as: str | None = None  # None: the profile runs the block under it; else the kind it derives from
    moves_input: bool = False  # its block's input waits off the device until backward (out and back)


SPECS: dict[DecisionKind, KindSpec] = {  # one per DecisionKind, read through DecisionKind.spec
    DecisionKind.KEEP: KindSpec(),
    DecisionKind.SELECTIVE: KindSpec(option="save", default="linear"),
    DecisionKind.FULL: KindSpec(),
    DecisionKind.OFFLOAD: KindSpec(option="offload", default="disk", train_applies=False, traced_as="full",
                                   moves_input=True),
}  # fmt: skip
KINDS = tuple(k.value for k in DecisionKind)  # the kinds' names, in DecisionKind's order
TRAIN_KINDS = tuple(k.value for k in DecisionKind if k.spec.train_applies)  # the kinds memfit train applies
_OPTIONS = {s.option: k.value for k, s in SPECS.items() if s.option}  # each option -> the kind that takes it


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
        spec = self.kind.spec
        for option, kind in _OPTIONS.items():
            if option == spec.option and getattr(self, option) is None:
                object.__setattr__(self, option, spec.default)
            elif getattr(self, option) is not None and option != spec.option:
                raise ValueError(f"memfit.Decision: {option}= is only for kind {kind!r}, not {self.kind.value!r}")

    @classmethod
    def parse(cls, spec: str | Decision, **options) -> Decision:
        """A Decision from its name (``"keep"``/``"none"``, ``"selective"``, ``"full"``,
        ``"offload"``), with the options that kind takes; a Decision is returned as is."""
        if isinstance(spec, Decision):
            return spec
        kind = DecisionKind.parse(spec)
        wanted = kind.spec.option
        return cls(kind, **{k: v for k, v in options.items() if k == wanted and v is not None})

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
