"""`memfit train --config FILE`: flag values from a TOML or YAML file; the flags override it.

Keys are the flag names (``checkpoint-dir`` or ``checkpoint_dir``), at the top level or in a
table named after the command (``[train]``). An unknown key is an error, not a silent no-op.
"""

from __future__ import annotations

import argparse
import sys


def read(path: str) -> dict:
    """The key-value pairs of a ``.toml``, ``.yaml`` or ``.yml`` file."""
    try:
        if path.endswith(".toml"):
            if sys.version_info >= (3, 11):
                import tomllib

                with open(path, "rb") as f:
                    return tomllib.load(f)
            raise ValueError("memfit: a TOML --config needs Python 3.11 or later (tomllib), or use YAML")
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise ValueError("memfit: a YAML --config needs PyYAML (pip install pyyaml), or use TOML") from None
            with open(path) as f:
                data = yaml.safe_load(f) or {}
            if not isinstance(data, dict):
                raise ValueError(f"memfit: --config {path!r} must map flag names to values")
            return data
    except OSError as e:
        raise ValueError(f"memfit: cannot read --config {path!r}: {e.strerror}") from None
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        if isinstance(e, ValueError) and str(e).startswith("memfit:"):
            raise
        raise ValueError(f"memfit: --config {path!r} is not valid: {e}") from None
    raise ValueError(f"memfit: --config {path!r}: use a .toml, .yaml or .yml file")


def with_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None):
    """``args`` parsed again with the values of ``args.config`` (if any) as the defaults."""
    path = getattr(args, "config", None)
    if not path:
        return args
    values = read(path)
    values = values.get(args.command, values) if isinstance(values.get(args.command), dict) else values
    sub = _subparser(parser, args.command)
    dests = {a.dest: a for a in sub._actions}
    defaults = {}
    for key, given in values.items():
        dest = key.replace("-", "_")
        if dest not in dests or dest in ("config", "help"):
            raise ValueError(f"memfit: --config {path!r}: unknown key {key!r} for `memfit {args.command}`")
        action = dests[dest]
        # read as on the command line, where a choice's type maps an old spelling to the new
        value = action.type(given) if action.choices is not None and callable(action.type) else given
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"memfit: --config {path!r}: {key} must be one of {list(action.choices)}, not {value!r}")
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("memfit's parser has subcommands")
