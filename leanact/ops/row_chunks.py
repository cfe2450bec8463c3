"""Rows of a row-wise op in chunks, so that its full-precision temporaries stay bounded.

A row-wise op computed in fp32 on 16-bit inputs (Hugging Face's RMSNorm upcasts the whole tensor,
squares it, scales it) allocates several fp32 copies of its input at once: at 1M tokens of a
2048-wide model, 8 GiB each. Running it over chunks of rows gives the same values (each row is
computed by the same ops) with the temporaries of one chunk only. Chunks start when the
temporaries of the whole tensor would exceed :data:`CHUNK_BYTES`; below that there is one chunk
(no extra launches).

On fake tensors (``leanact.estimate``) only the first two and the last chunk are returned: the
callers' chunks allocate alike (temporaries freed before the next chunk, results written into
tensors allocated once), so those set the peak; the estimate's time then does not grow with the
number of chunks. A caller whose chunks do not allocate alike must not use :func:`row_slices`.
"""
from __future__ import annotations

import contextlib
import sys

from . import fake_rules

__all__ = ["CHUNK_BYTES", "row_slices"]

CHUNK_BYTES = 256 << 20  # the most bytes of fp32 temporaries (one copy of the rows) per chunk


def row_slices(rows: int, row_bytes: int, limit: int | None = None) -> list[slice]:
    """Slices of ``rows`` rows such that each chunk's rows take at most ``limit`` bytes
    (default :data:`CHUNK_BYTES`) at ``row_bytes`` bytes a row; one slice when all fit (at least
    one row per chunk)."""
    limit = CHUNK_BYTES if limit is None else limit
    if rows * row_bytes <= limit or rows <= 1:
        return [slice(0, rows)]
    step = max(1, limit // max(1, row_bytes))
    return _kept([slice(i, min(rows, i + step)) for i in range(0, rows, step)])


def _kept(parts: list[slice]) -> list[slice]:
    """The chunks that run: all of them but on fake tensors (the rule below)."""
    return parts


@contextlib.contextmanager
def _fake_rule(run: fake_rules.FakeRun):
    def some(parts: list[slice]) -> list[slice]:
        return [*parts[:2], parts[-1]] if fake_rules.faking() and len(parts) > 3 else parts

    with fake_rules.swapped(sys.modules[__name__], _kept=some if run.fewer_iterations else None):
        yield


fake_rules.register("row chunks", rule=_fake_rule)
