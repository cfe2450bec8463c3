"""Byte sizes on the command line: ``16GiB``, ``512MiB``, ``10GB``, ``1e9``."""
from __future__ import annotations

import re

__all__ = ["parse_size", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (B, KB/MB/GB/TB = powers of 1000,
    KiB/MiB/GiB/TiB = powers of 1024; case-insensitive). Raises ValueError on anything else."""
    m = _PATTERN.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 16GiB, 512MiB, 10GB or 1e9 (bytes)")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit (B, KiB, MiB, GiB, TiB), 3 significant digits or more."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
