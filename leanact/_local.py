"""A thread-local setting entered and left by a ``with`` block (restored even on KeyboardInterrupt)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

__all__ = ["setting"]


@contextlib.contextmanager
def setting(local: threading.local, name: str, value: Any, default: Any = False) -> Iterator[None]:
    """Set ``local.<name>`` to ``value`` inside the block; the previous value (``default`` if none)
    comes back when it exits, however it exits."""
    before = getattr(local, name, default)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)
