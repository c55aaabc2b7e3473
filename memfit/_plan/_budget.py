"""Memory budgets as users write them: 6GB, 3.5GiB, 800MB, or a number of bytes."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    # A bare letter is binary, as in `free -g`, Slurm's --mem and ulimit.
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_PATTERN = re.compile(r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?[0-9]+)?|[-+]?inf|nan)\s*([A-Za-z]*)\s*$", re.I)
_HOW = "write a whole number of bytes or a number with a unit, like '6GB', '6 GiB', '6G' or '800MB'"


def parse_bytes(budget: int | float | str) -> int:
    """Bytes from ``budget``: a whole number of bytes, or a number with a unit (KB/MB/GB/TB:
    powers of 10; KiB/MiB/GiB/TiB and the bare K/M/G/T: powers of 2), case and spaces ignored.
    ``parse_bytes("3.5GiB") == 3758096384``. Raises ValueError for anything else, for a
    number that is not finite or not positive, and for a fraction of a byte."""
    if isinstance(budget, bool):
        raise TypeError(f"memfit: a memory budget must be a number of bytes or a string; {_HOW}")
    if isinstance(budget, (int, float)):
        value, unit = float(budget), ""
    elif isinstance(budget, str):
        m = _PATTERN.match(budget)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"memfit: cannot read the memory budget {budget!r}; {_HOW}")
        value, unit = float(m.group(1)), m.group(2).upper()
    else:
        raise TypeError(f"memfit: a memory budget must be a number of bytes or a string, got {type(budget).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"memfit: a memory budget must be a finite number, got {budget!r}; {_HOW}")
    if value <= 0:
        raise ValueError(f"memfit: a memory budget must be positive, got {budget!r}")
    if _UNITS[unit] == 1 and value != int(value):
        raise ValueError(f"memfit: {budget!r} is a fraction of a byte; a budget without a unit is bytes: {_HOW}")
    return int(value * _UNITS[unit])


def format_bytes(n: float, *, up: bool = False) -> str:
    """``n`` bytes in the largest binary unit, to 2 decimals; ``up``: rounded up, for a budget
    that must be enough (a smallest budget printed rounded down does not fit)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{(math.ceil(n / size * 100) / 100 if up else n / size):.2f} {unit}"
    return f"{math.ceil(n) if up else n:.0f} B"


def describe_bytes(n: float) -> str:
    """``n`` as :func:`format_bytes` writes it, after the decimal amount a user wrote when it is
    a whole number of KB, MB, GB or TB (to 2 decimals): ``describe_bytes(80 * 10**9) == "80 GB = 74.51 GiB"``."""
    binary = format_bytes(n)
    if n % 2**20 == 0:  # a binary amount: as written
        return binary
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size and (n * 100) % size == 0:
            return f"{n / size:g} {unit} = {binary}"
    return binary
