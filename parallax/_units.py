"""Byte counts for people: ``format_bytes`` writes them, ``parse_bytes`` reads budgets like ``"16GB"``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def binary_unit(n: int) -> tuple[int, str]:
    """The largest binary unit ``n`` bytes fill at least once, as ``(bytes per unit, name)``.

    Example:
        >>> binary_unit(3 * 2**20), binary_unit(512)
        ((1048576, 'MiB'), (1, 'B'))
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return scale, unit
    return 1, "B"


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units.

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(512)
        ('3.0 MiB', '512 B')
    """
    scale, unit = binary_unit(n)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n} B"


def parse_bytes(value: int | float | str, name: str = "memory_budget") -> int:
    """A byte count from an int or a string with a unit (``"16GB"`` is 16e9, ``"16GiB"`` is 16 × 2**30).

    Example:
        >>> parse_bytes("16GB"), parse_bytes("1.5 GiB"), parse_bytes(1024)
        (16000000000, 1610612736, 1024)
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}; give bytes as an int or a string such as '16GB' or '80GiB'.")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{name}={value!r}; give a positive number of bytes.")
        return int(value)
    match = _BUDGET.match(str(value))
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{name}={value!r}; give bytes as an int or a string such as '16GB' or '80GiB' "
                         f"(units: {', '.join(u for u in _UNITS if u)}).")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
