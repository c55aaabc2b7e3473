"""A command's flags generated from its config dataclass (See [Note: Flags from the config])."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
import warnings
from typing import Any

from memfit._checkpoint._decision import DecisionKind

# [Note: Flags from the config]
# A command's config dataclass (memfit/cli/_config.py) is the one declaration of its flags, as
# torchtitan's JobConfig is: each init field is the flag --field-name (underscores as dashes),
# its default the field's (a field without one is a required flag), its type the annotation's
# (int | None is int; bool is a switch; tuple[str, ...] takes one or more values), and its help
# and any other argparse keywords (choices, metavar, nargs, const) the field's metadata, written
# with flag(...). add_flags turns the fields into the parser's arguments, in field order;
# memfit/cli/__init__.py:_parser adds a subcommand per config and no flag of its own, and
# tests/unit/test_cli_flags.py reads the parser back against the dataclasses.

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
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kwargs: dict[str, Any] = {"required": True} if required else {"default": f.default}
        kwargs.update(f.metadata)
        scalar = _scalar(hints[f.name], f"{config.__name__}.{f.name}")
        if typing.get_origin(_optional(hints[f.name])) is tuple:
            kwargs.setdefault("nargs", "+")
        if scalar is bool and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "type" not in kwargs and scalar is not str and kwargs.get("action") != "version":
            kwargs["type"] = scalar
        parser.add_argument(flag_name(f.name), **kwargs)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, naming the command and where its flags are
    listed (See [Note: One line per bad input] in memfit/cli/_config.py)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists the flags\n")


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to each flag that has a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def joined_negatives(argv: list[str]) -> list[str]:
    """``argv`` with each ``--flag -VALUE`` written ``--flag=-VALUE``: argparse reads a value
    that starts with a dash and is not a plain number (``--budget -1GB``) as a missing value, so
    it would never reach the config's check."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def flag_name(field: str) -> str:
    """The flag of a config field: ``--checkpoint-dir`` for ``checkpoint_dir``."""
    return "--" + field.replace("_", "-")


def _optional(hint: Any) -> Any:
    """The annotation without its ``| None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _scalar(hint: Any, where: str) -> type:
    """The type a flag's text becomes: the annotation, without its ``| None``; a tuple's items'."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if len(typing.get_args(hint)) != 2 or type(None) not in typing.get_args(hint):
            raise TypeError(f"memfit: the flag of {where} must have one type (or it | None), not {hint}")
        hint = _optional(hint)
    if typing.get_origin(hint) is tuple and len(typing.get_args(hint)) == 2 and typing.get_args(hint)[1] is ...:
        hint = typing.get_args(hint)[0]
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
