"""A command's flags generated from its config dataclass (See [Note: Flags from the config])."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
import warnings
from typing import Any

from memfit._checkpoint._decision import DecisionKind

# [Note: Flags from the config]
# A command's config dataclass is the one declaration of its flags, as torchtitan's JobConfig
# is: each init field is the flag --field-name (underscores as dashes), its default the
# field's, its type the annotation's (int | None is int; bool is a switch), and its help and
# any other argparse keywords (choices, metavar, nargs, const) the field's metadata, written
# with flag(...). add_flags turns the fields into the parser's arguments, in field order.

DEVICES = ("auto", "cpu", "cuda")
DEVICE_HELP = "cuda: GPU LOCAL_RANK with NCCL; cpu: gloo; auto: cuda when there is a GPU (default: auto)"


def flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """A config field's metadata: the flag's help and argparse's other keywords for it."""
    return {"help": help, **argparse_kwargs}


def add_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """Add one flag per init field of the dataclass ``config`` (See [Note: Flags from the config])."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        kwargs = {"default": f.default, **f.metadata}
        scalar = _scalar(hints[f.name], f"{config.__name__}.{f.name}")
        if scalar is bool and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "type" not in kwargs and scalar is not str:
            kwargs["type"] = scalar
        parser.add_argument(flag_name(f.name), **kwargs)


def flag_name(field: str) -> str:
    """The flag of a config field: ``--checkpoint-dir`` for ``checkpoint_dir``."""
    return "--" + field.replace("_", "-")


def _scalar(hint: Any, where: str) -> type:
    """The type a flag's text becomes: the annotation, without its ``| None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"memfit: the flag of {where} must have one type (or it | None), not {hint}")
        hint = args[0]
    if hint not in (str, int, float, bool):
        raise TypeError(f"memfit: the flag of {where} needs a str, int, float or bool field, not {hint}")
    return hint


def decision_kind(text: str) -> str:
    """A ``--checkpointing``/``--strategies`` value: a DecisionKind's name; ``none``, the old
    spelling of ``keep``, still works, with a warning."""
    if text == "none":
        warnings.warn(
            "memfit: 'none' is now spelt 'keep' (memfit.DecisionKind.KEEP, the library's name); 'none' will be removed",
            FutureWarning,
            stacklevel=2,
        )
        return DecisionKind.KEEP.value
    return text
