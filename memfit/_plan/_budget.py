"""Memory budgets as users write them: 6GB, 3.5GiB, 800MB, or a number of bytes."""

from __future__ import annotations

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
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(budget: int | float | str) -> int:
    """Bytes from ``budget``: a number, or a string with a unit (KB/MB/GB: powers of 10;
    KiB/MiB/GiB: powers of 2). ``parse_bytes("3.5GiB") == 3758096384``."""
    if isinstance(budget, bool):
        raise TypeError("memfit: a memory budget must be a number of bytes or a string like '6GB'")
    if isinstance(budget, (int, float)):
        value = budget
    elif isinstance(budget, str):
        m = _PATTERN.match(budget)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(
                f"memfit: cannot read the memory budget {budget!r}; write bytes or a number with a unit, "
                "like '6GB', '3.5GiB' or '800MB'"
            )
        value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    else:
        raise TypeError(f"memfit: a memory budget must be a number of bytes or a string, got {type(budget).__name__}")
    if value <= 0:
        raise ValueError(f"memfit: a memory budget must be positive, got {budget!r}")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
