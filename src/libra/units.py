"""Byte quantities: human strings such as ``"6GiB"`` or ``"800MB"`` to int bytes and back. The only place that parses them."""

from __future__ import annotations

import math
import re

from libra.errors import LibraError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, what: str = "libra.plan: budget") -> int:
    """Parses a byte quantity.

    Args:
        value: an ``int`` of bytes, or a string of a number and a unit: ``"6GiB"``, ``"800MB"``, ``"1.5 GiB"``,
            ``"4096"``. Binary (KiB, MiB, GiB, TiB) and decimal (kB, MB, GB, TB) units; case does not matter.
        what: the name used in error messages.

    Returns:
        The number of bytes, a positive int.

    Raises:
        LibraError: the value is not a positive whole number of bytes (fractions such as ``0.5`` or ``"50%"`` are
            rejected: a budget is bytes, never a share).

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LibraError(
            f"{what}: expected an int of bytes or a string such as '6GiB', got {type(value).__name__} {value!r}. "
            "A budget is a number of bytes, never a fraction; pass e.g. 6 * 2**30 or '6GiB'."
        )
    if isinstance(value, int):
        n = value
    else:
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise LibraError(
                f"{what}: could not parse {value!r} as a byte quantity. Expected a number and a unit, "
                "such as '6GiB', '800MB', '1.5 GiB' or '4096' (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)."
            )
        number = float(match.group(1))
        n = int(math.floor(number * _UNITS[unit]))
    if n <= 0:
        raise LibraError(f"{what}: expected a positive number of bytes, got {value!r}. Pass e.g. '6GiB'.")
    return n


def format_bytes(n: int | float) -> str:
    """Formats bytes in binary units with three significant digits, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units:
        if n < 1024 or unit == units[-1]:
            break
        n /= 1024
    if unit == "B":
        return f"{sign}{int(n)} B"
    return f"{sign}{n:.1f} {unit}" if n >= 100 else f"{sign}{n:.2f} {unit}"
