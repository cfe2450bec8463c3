"""Formatting shared by the CLI, ``Plan.explain`` and ``Estimate``: byte sizes (budgets such as
``16GiB``, ``512MiB``, ``10GB``, ``1e9``, or a number of bytes; binary units for display) and compact
rich tables that fit 80 columns. Depends on nothing else in leanact."""
from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

__all__ = ["parse_size", "format_bytes", "unit_for", "format_in", "compact_table", "MAX_SIZE"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE = 2**63 - 1  # the largest byte count accepted (int64)
_EXAMPLES = "e.g. '16GiB', '512MiB', '10GB', '1e9' or a whole number of bytes"


def _rational(number):
    return number if isinstance(number, (str, numbers.Rational)) else float(number)


def parse_size(value: str | int | float, what: str = "size") -> int:
    """Bytes in ``value``: a whole number of bytes, or a string with a number and an optional unit
    (B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024; case-insensitive). The
    result must be a whole number of bytes from 1 to :data:`MAX_SIZE`; anything else raises
    ValueError (TypeError for a non-number), naming ``what``, the value and the fix."""
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {what} {value!r}: use a number with an optional unit, {_EXAMPLES} "
                             f"(units: {', '.join(u for u in _UNITS if u)})")
        number, unit = m.group(1), _UNITS[m.group(2).lower()]
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):
            raise ValueError(f"{what} {value!r} is not a finite number of bytes: give one, {_EXAMPLES}")
        number, unit = value, 1
    else:
        raise TypeError(f"{what} must be a number of bytes or a string, {_EXAMPLES}; got {type(value).__name__} "
                        f"{value!r}")
    try:  # the range first: an exact Fraction of '1e999999999' would take forever
        approx = float(number) * unit
    except OverflowError:
        approx = math.inf
    exact = Fraction(_rational(number)) * unit if 0.5 <= approx <= 2 * MAX_SIZE else Fraction(approx > 1)
    if exact < 1:
        raise ValueError(f"{what} {value!r} is less than one byte: give a positive size, {_EXAMPLES}")
    if approx > 2 * MAX_SIZE or exact > MAX_SIZE:
        raise ValueError(f"{what} {value!r} is more than {MAX_SIZE:,} bytes (2**63 - 1): give the memory to plan "
                         f"for, {_EXAMPLES}")
    if exact.denominator != 1:
        raise ValueError(f"{what} {value!r} is not a whole number of bytes: give whole bytes, {_EXAMPLES}")
    return int(exact)


_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit (B, KiB, MiB, GiB, TiB), 3 significant digits or more."""
    unit, scale = unit_for([n])
    return f"{format_in(n, scale)} {unit}"


def unit_for(values) -> tuple[str, int]:
    """(name, scale) of the largest binary unit not above the largest ``abs(value)``: one unit for a
    column of sizes, so that it can go in the column's header and every cell stays short."""
    top = max((abs(v) for v in values), default=0)
    for unit, scale in _BINARY:
        if top >= scale:
            return unit, scale
    return "B", 1


def format_in(n: float, scale: int) -> str:
    """``n`` bytes in the unit of ``scale`` (from :func:`unit_for`), without the unit's name."""
    return f"{n / scale:.2f}" if scale > 1 else f"{int(n)}"


def compact_table(title: str | None = None, caption: str | None = None):
    """A rich Table without side borders or inner padding (units go in the headers, the legend in
    the caption), so that it fits 80 columns."""
    from rich import box
    from rich.table import Table

    return Table(title=title, caption=caption or None, box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False,
                 show_edge=False, caption_justify="left")
