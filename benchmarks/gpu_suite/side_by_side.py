"""Modes timed side by side, in turns (the ``head`` and ``steps`` parts): :class:`Mode`,
:func:`interleave`, :func:`compare` (the modes kept allocated together when they fit, else one
after another), and the cells of ratios and targets.
"""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time

from .common import Recorder, allocated, attempt, dev, empty_cache, max_allocated, reset_peak, sync


@dataclasses.dataclass
class Mode:
    """One side of an interleaved comparison. ``step()`` is the timed unit (a training step, a head's
    forward + backward); ``own`` the bytes the mode keeps between its steps (model, optimizer state,
    inputs), added to what its step allocates on top of what was allocated before it, so that its
    peak is that of the mode alone whatever the other modes keep allocated meanwhile (0 for the
    head: its peak is the transient above the inputs)."""

    label: str
    step: object = None  # callable, None once released or failed
    own: float = 0.0
    times: list = dataclasses.field(default_factory=list)  # seconds of the timed steps
    peak: float = float("nan")  # bytes, the most over the timed steps (NaN on the CPU)
    failed: tuple | None = None  # (kind "OOM" / "error", what)

    def measured(self) -> tuple[float, float]:
        """(seconds, peak bytes) of one step (synchronized; ``reset_peak_memory_stats`` before it)."""
        sync()
        before = allocated()
        reset_peak()
        t0 = time.perf_counter()
        self.step()
        sync()
        return time.perf_counter() - t0, max_allocated() - before + self.own

    def fail(self, kind: str, what: str) -> None:
        self.failed = (kind, what)
        self.release()

    def release(self) -> None:
        self.step = None
        gc.collect()
        empty_cache()

    @property
    def ms(self) -> float:
        return statistics.median(self.times) * 1000 if self.times else float("nan")


def interleave(modes: list[Mode], rounds: int, warmup: int = 1, deadline: float | None = None) -> None:
    """The modes' steps in turns, A, B, C, A, B, C, ...: ``warmup`` untimed rounds, then ``rounds``
    timed ones (fewer once ``time.perf_counter()`` passes ``deadline``; at least one). Times and the
    peak go to each mode; a mode whose step fails (out of memory or another error) leaves the
    rotation with ``failed`` set and its state released, and the others go on."""
    for r in range(warmup + max(1, rounds)):
        if r > warmup and deadline is not None and time.perf_counter() > deadline:
            break
        for m in modes:
            if m.step is None:
                continue
            out, kind, what = attempt(m.measured, catch_all=True)
            if kind:
                m.fail(kind, what)
            elif r >= warmup:
                m.times.append(out[0])
                m.peak = out[1] if m.peak != m.peak else max(m.peak, out[1])


def fits_together(n: int, own: float, peak: float, total: float, share: float = 0.9) -> bool:
    """Whether ``n`` modes can stay allocated at once: n - 1 modes' resident bytes (``own``, the
    first mode's: model, optimizer state, inputs) plus the first mode's step peak (its own resident
    bytes included) within ``share`` of the device's ``total`` memory."""
    return (n - 1) * own + peak <= share * total


def _total_memory() -> float | None:
    """The GPU's memory in bytes; None on the CPU (a smoke run keeps its tiny models together)."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if dev() == "cuda" else None


def compare(rec: Recorder, group: str, builders: list, rounds: int, deadline: float | None = None) -> list[Mode]:
    """Modes (``label, build`` in ``builders``; ``build()`` makes a model and returns its step) built
    in order, one step each after building (kernels compile, the optimizer allocates its state; the
    resident bytes are measured after it), then timed in turns (:func:`interleave`) while all stay
    allocated. On CUDA, when the first mode's resident bytes and step peak say they do not all fit
    (:func:`fits_together`), each is built, timed and freed before the next is built instead (a note
    says which). A mode that fails to build or to step keeps ``failed``; the others go on."""
    modes = [Mode(label) for label, _ in builders]
    together, alive = None, []
    for i, (m, (_, build)) in enumerate(zip(modes, builders)):
        before = allocated()
        m.step, kind, what = attempt(build, catch_all=True)  # no other reference: release() frees the model
        if not kind:
            _, kind, what = attempt(m.measured, catch_all=True)
        if kind:
            m.fail(kind, what)
            continue
        m.own = allocated() - before
        if together is None:
            together = True
            total = _total_memory()
            if total is not None and len(modes) > 1:
                out, kind, what = attempt(m.measured, catch_all=True)  # a step with the optimizer's state
                if kind:
                    m.fail(kind, what)
                    together = None
                    continue
                together = fits_together(len(modes), m.own, out[1], total)
                need = (len(modes) - 1) * m.own + out[1]
                rec.note(f"{group}: {m.label} keeps {m.own / 2**30:.1f} GiB, its step peaks at "
                         f"{out[1] / 2**30:.1f} GiB; "
                         f"{len(modes)} models at once need ~{need / 2**30:.1f} GiB of {total / 2**30:.1f} GiB: "
                         + ("all kept allocated, steps interleaved" if together else
                            "each built, timed and freed in turn instead (not interleaved)"))
        if together:
            alive.append(m)
            continue
        share = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / (len(modes) - i)
        interleave([m], rounds, deadline=share)
        m.release()
    interleave(alive, rounds, deadline=deadline)
    return modes


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if a == a and b == b and b else "n/a"


def check(what: str, a: float, b: float, limit: float) -> str:
    """"what 0.970x (target ≤ 1.00x: ok)", "n/a" where a side is missing."""
    if not (a == a and b == b and b):
        return f"{what} n/a"
    return f"{what} {a / b:.3f}x (target ≤ {limit:.2f}x: {'ok' if a / b <= limit else 'no'})"


def failures(modes: list[Mode], third_party: tuple = ("Liger", "torch")) -> list[str]:
    """Modes of this project (not Liger's or torch's) that failed with an error other than an OOM."""
    return [m.label for m in modes if m.failed and m.failed[0] == "error" and not m.label.startswith(third_party)]
