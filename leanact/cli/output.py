"""What the CLI prints besides its tables: a busy-machine warning, and quiet transformers logging."""
from __future__ import annotations

import contextlib
import os

__all__ = ["busy_warning", "quiet_transformers"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy_warning(load: float | None = None, cores: int | None = None) -> str | None:
    """A warning when the 1-minute load average is above the number of cores this process may use
    (time ratios measured then are unreliable), else None. Memory is exact whatever the load."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform
            return None
    cores = _cores() if cores is None else cores
    if load <= cores:
        return None
    return (f"warning: the machine is busy (load average {load:.1f} > {cores} cores): time ratios are unreliable; "
            "the memory columns are exact. Run on an idle machine, or with OMP_NUM_THREADS=1 to reduce contention.")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' logging at error level inside the block (its warnings about random-weight configs,
    e.g. ``loss_type=None`` or token ids outside a tiny vocabulary, say nothing about memory)."""
    try:
        from transformers.utils import logging
    except ImportError:
        yield
        return
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
