"""CPU offload of what a layer keeps for backward (a :mod:`leanact.saved` transform).

While :class:`OffloadTransform` is active (around one layer's forward), every tensor autograd
keeps that is at least ``threshold`` bytes (1 MiB by default) and is not a parameter is copied
to host buffers taken from a :class:`HostPool` (in pieces of :data:`PIECE_BYTES`); the device
tensor is no longer referenced by the graph and is freed as soon as the forward drops it. Kept on
the device: the small tensors only. In backward the host copy is copied back (once per storage:
views of one buffer, e.g. Q/K/V of a fused projection, share one host copy and one device copy; a
view smaller than a quarter of its storage is copied alone) and the host buffers return to the
pool when the graph is freed.

CUDA: host buffers are pinned; device→host copies run on a side stream (the source is
``record_stream``-ed so the allocator does not reuse it before the copy ends); in backward the
first unpack of a layer prefetches the previous offloaded layer's copies on the side stream, and
the compute stream waits on an event only where a copy is used. CPU: the same copies, synchronous
(the "host" buffer is a real copy in the pool, so tests exercise every path).

In-place safety: the version of the saved tensor is recorded at pack time; at the end of the
layer's forward and at unpack, a source tensor still alive whose version changed raises torch's
"modified by an inplace operation" error. (A source modified and then freed before either check
cannot be seen; backward then uses the value at save time, which is the one its gradient needs.)

With recipes (:mod:`leanact.recompute`): a RecipeTransform inside an offloaded layer sees this
transform outside it and does not claim tensors (the originals would stay pinned on the device),
so its tensors are offloaded like the others.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake

from leanact._local import setting
from leanact.ops import fake_rules
from leanact.saved import SavedTensorTransform

__all__ = ["HostPool", "HostMemoryError", "OffloadTransform", "KeptSplit", "split_kept", "is_host_copy",
           "is_host_copy_key", "allocating_host", "prefetch_as_cuda", "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 1 << 20
_POOLS: "weakref.WeakSet[HostPool]" = weakref.WeakSet()
_STATE = threading.local()  # .allocating: inside HostPool.take; .emulate: prefetch_as_cuda() is on


def allocating_host() -> bool:
    """Whether the current thread is allocating a host buffer of an offload pool (lets a memory
    tracker, e.g. :func:`leanact.estimate`'s, count it as host memory, not device memory)."""
    return getattr(_STATE, "allocating", False)


@contextlib.contextmanager
def prefetch_as_cuda():
    """Within it, offload transforms prefetch CPU copies as they would CUDA ones (one layer ahead
    in backward), so a CPU trace (:func:`leanact.estimate` with ``device="cuda"``) holds the
    device copies for as long as a GPU would."""
    with setting(_STATE, "emulate", True):
        yield


class HostMemoryError(MemoryError):
    """An offload pool would exceed its host-memory limit."""


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (unknown: no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostPool:
    """Host buffers (uint8, pinned when offloading from CUDA) reused by exact byte size.

    ``limit``: the most bytes the pool may hold (free + lent); None (default): what the host has
    available when a buffer is allocated (``MemAvailable`` less :attr:`HOST_MARGIN`), so a step
    that would exhaust host memory raises :class:`HostMemoryError` (naming the bytes and the fix)
    instead of swapping or being killed. ``peak``: the most bytes the pool ever held."""

    HOST_MARGIN = 2 << 30  # left to the rest of the process and the system when limit is None

    def __init__(self, limit: int | None = None):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"HostPool(limit={limit!r}): a number of bytes >= 0, or None (the host's available "
                             "memory)")
        self.limit = limit
        self._free: dict[tuple[int, bool, bool], list[torch.Tensor]] = defaultdict(list)  # (bytes, pinned, fake)
        # storages of buffers owned by the pool (free or lent) -> the buffer, weakly (a key whose
        # buffer is gone is stale: its address may be a new storage's)
        self._keys: dict[int, weakref.ref] = {}
        self._streams: dict[Any, Any] = {}
        self.allocated = 0  # bytes ever allocated (free + lent)
        self.peak = 0
        _POOLS.add(self)

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        # fake buffers (an estimate's) and real ones never mix: a fake one would take a real copy
        # and give back no values
        free = self._free[(nbytes, pin, detect_fake_mode() is not None)]
        if free:
            return free.pop()
        self._check_room(nbytes)
        with setting(_STATE, "allocating", True):
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._keys[buf.untyped_storage()._cdata] = weakref.ref(buf)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        return buf

    def _check_room(self, nbytes: int) -> None:
        if detect_fake_mode() is not None:  # an estimate's fake buffer allocates nothing
            return
        if self.limit is not None:
            room, what = self.limit - self.allocated, f"its limit of {self.limit:,} bytes"
        else:
            avail = _available_host_bytes()
            if avail is None:
                return
            room, what = avail - self.HOST_MARGIN, f"the host's available memory ({avail:,} bytes, less a margin)"
        if nbytes > room:
            raise HostMemoryError(
                f"leanact offload: a {nbytes:,}-byte host buffer does not fit {what}; the pool already holds "
                f"{self.allocated:,} bytes. Fix: offload fewer layers (a plan with 'full' or 'lean' on some), "
                "a shorter sequence or smaller batch, or more host memory (HostPool(limit=...) raises the cap).")

    def give(self, buf: torch.Tensor, pin: bool) -> None:
        self._free[(buf.numel(), pin, is_fake(buf))].append(buf)

    def free_bytes(self) -> int:
        return sum(b.numel() for bufs in self._free.values() for b in bufs)

    def clear(self) -> None:
        """Drop the free buffers (lent ones come back later)."""
        for bufs in self._free.values():
            for b in bufs:
                self._keys.pop(b.untyped_storage()._cdata, None)
                self.allocated -= b.numel()
        self._free.clear()

    def owns(self, storage_key: int) -> bool:
        ref = self._keys.get(storage_key)
        buf = ref() if ref is not None else None
        if buf is None or buf.untyped_storage()._cdata != storage_key:
            if ref is not None:
                del self._keys[storage_key]
            return False
        return True

    def stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def is_host_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in an offload pool's host buffer."""
    return is_host_copy_key(t.untyped_storage()._cdata)


def is_host_copy_key(storage_key: int) -> bool:
    """Whether a storage (a meter record's ``storage_key``) is an offload pool's host buffer."""
    return any(p.owns(storage_key) for p in list(_POOLS))


@dataclass
class KeptSplit:
    device: int  # bytes kept on the compute device
    offloaded: int  # bytes kept in offload host buffers


def split_kept(meter) -> KeptSplit:
    """Split a :class:`~leanact.memory.SavedTensorMeter`'s counted bytes into device and offloaded."""
    pools = list(_POOLS)
    dev = off = 0
    for r in meter.counted():
        if any(p.owns(r.storage_key) for p in pools):
            off += r.counted_bytes
        else:
            dev += r.counted_bytes
    return KeptSplit(dev, off)


#: Host buffers are taken in pieces of at most this many bytes: PyTorch's pinned-memory allocator
#: rounds each allocation up to a power of two, so a 6.5 GiB copy in one buffer would hold 8 GiB;
#: in 64 MiB pieces it holds at most 64 MiB more than it copies, and pieces are reused across sizes.
PIECE_BYTES = 1 << 26


def _pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    """(first element, elements) of each host piece of a ``numel``-element copy."""
    step = max(1, PIECE_BYTES // element_size)
    return [(i, min(step, numel - i)) for i in range(0, numel, step)] or [(0, 0)]


class _HostCopy:
    """One storage (or one tensor's elements) copied to host buffers (:data:`PIECE_BYTES` each)."""

    __slots__ = ("pool", "bufs", "pieces", "pin", "numel", "dtype", "device", "src", "version", "event", "dirty",
                 "_dev", "_dev_weak", "_dev_event", "__weakref__")

    def __init__(self, pool: HostPool, flat: torch.Tensor, src: torch.Tensor):
        self.pool, self.numel, self.dtype, self.device = pool, flat.numel(), flat.dtype, flat.device
        self.pin = flat.is_cuda
        self.pieces = _pieces(flat.numel(), flat.element_size())
        self.bufs: list[torch.Tensor] = []
        for _, n in self.pieces:
            self.bufs.append(pool.take(n * flat.element_size(), self.pin))
        self.src, self.version, self.dirty = weakref.ref(src), src._version, False
        self.event = None
        self._dev = None  # prefetched device copy (strong until first use)
        self._dev_weak = None
        self._dev_event = None
        if flat.is_cuda:
            stream = pool.stream(flat.device)
            stream.wait_stream(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(stream):
                self._copy_pieces(flat, to_host=True, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            flat.record_stream(stream)
        else:
            self._copy_pieces(flat, to_host=True)

    def _copy_pieces(self, dev: torch.Tensor, to_host: bool, non_blocking: bool = False) -> None:
        for buf, (start, n) in zip(self.bufs, self.pieces):
            host, part = buf.view(self.dtype), dev[start:start + n]
            (host.copy_(part, non_blocking=non_blocking) if to_host else part.copy_(host, non_blocking=non_blocking))

    def check(self) -> None:
        src = self.src()
        if src is not None and src._version != self.version:
            self.dirty = (list(src.shape), src.type(), src._version)
        if self.dirty:
            shape, typ, ver = self.dirty
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{typ} {shape}] is at version {ver}; expected version {self.version} instead "
                "(checked by leanact's offload). Hint: do not modify in place a tensor that autograd keeps "
                "for backward; use an out-of-place op (e.g. x = x + 1).")

    def mark(self) -> None:
        src = self.src()
        if src is not None and src._version != self.version and not self.dirty:
            self.dirty = (list(src.shape), src.type(), src._version)

    def _issue(self) -> None:
        """Start the host→device copy (side stream on CUDA)."""
        dev = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":
            stream = self.pool.stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._copy_pieces(dev, to_host=False, non_blocking=True)
                self._dev_event = torch.cuda.Event()
                self._dev_event.record(stream)
        else:
            self._copy_pieces(dev, to_host=False)
        self._dev = dev

    def prefetch(self) -> None:
        if self._dev is None and (self._dev_weak is None or self._dev_weak() is None):
            self._issue()

    def device_copy(self) -> torch.Tensor:
        dev = self._dev_weak() if self._dev_weak is not None else None
        if dev is not None:
            return dev
        if self._dev is None:
            self._issue()
        dev, self._dev = self._dev, None
        if self._dev_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._dev_event)
            self._dev_event = None
        self._dev_weak = weakref.ref(dev)  # shared by the other views unpacked while it lives
        return dev

    def __del__(self):
        try:
            for buf in self.bufs:
                self.pool.give(buf, self.pin)
        except Exception:  # interpreter shutdown
            pass


class _Handle:
    __slots__ = ("copy", "size", "stride", "offset", "whole")

    def __init__(self, copy: _HostCopy, t: torch.Tensor, whole: bool):
        self.copy, self.whole = copy, whole
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class OffloadTransform(SavedTensorTransform):
    """Keeps host copies of the tensors saved while active (module doc). ``previous``: the
    transform of the layer that runs next in backward, prefetched at this layer's first unpack."""

    def __init__(self, pool: HostPool | None = None, threshold: int = DEFAULT_THRESHOLD):
        self.pool = pool if pool is not None else HostPool()
        self.threshold = threshold
        self.previous: OffloadTransform | None = None
        self._by_storage: dict[int, weakref.ref] = {}
        self._copies: "weakref.WeakSet[_HostCopy]" = weakref.WeakSet()
        self._prefetched = False
        self.offloaded = 0  # packs replaced by a host copy (all time)

    # -- forward ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Handle | None:
        if (torch.compiler.is_compiling() or t.layout != torch.strided
                or (type(t) is not torch.Tensor and not is_fake(t))):
            return None
        if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
            return None
        if t.device.type not in ("cpu", "cuda") or t.numel() * t.element_size() < self.threshold:
            return None
        storage = t.untyped_storage()
        size = t.element_size()
        whole = storage.nbytes() <= 4 * t.numel() * size and storage.nbytes() % size == 0
        key = storage._cdata
        copy = None
        if whole:
            ref = self._by_storage.get(key)
            copy = ref() if ref is not None else None
            if copy is not None:
                src = copy.src()
                if (src is None or src.untyped_storage()._cdata != key or copy.version != t._version
                        or copy.dtype != t.dtype):
                    copy = None
        if copy is None:
            with torch.no_grad():
                flat = t.detach().as_strided((storage.nbytes() // size,), (1,), 0) if whole else t.detach().reshape(-1)
                copy = _HostCopy(self.pool, flat, t)
            if whole:
                self._by_storage[key] = weakref.ref(copy)
            self._copies.add(copy)
        self.offloaded += 1
        self._prefetched = False
        return _Handle(copy, t, whole)

    def end_forward(self) -> None:
        """Called when the layer's forward returns: records in-place changes of sources."""
        for c in list(self._copies):
            c.mark()
        self._by_storage = {k: r for k, r in self._by_storage.items() if r() is not None}

    # -- backward --------------------------------------------------------------------------
    def unpack(self, h: _Handle) -> torch.Tensor:
        h.copy.check()
        if not self._prefetched:
            self._prefetched = True
            if self.previous is not None:
                self.previous.prefetch()
        dev = h.copy.device_copy()
        if h.whole:
            return dev.as_strided(h.size, h.stride, h.offset)
        return dev.view(h.size)

    def prefetch(self) -> None:
        """Start copying this layer's host copies back (side stream on CUDA; no-op on the CPU,
        where copies are synchronous and made at unpack, unless :func:`prefetch_as_cuda`)."""
        emulate = getattr(_STATE, "emulate", False)
        for c in list(self._copies):
            if c.device.type == "cuda" or emulate:
                c.prefetch()

    def kept_tensors(self, h: _Handle) -> list[torch.Tensor]:
        return list(h.copy.bufs)


@contextlib.contextmanager
def _fake_rule(run: fake_rules.FakeRun):
    """On fake tensors a copy into the host buffers (or back into the device buffer) allocates
    nothing: the piece-by-piece copies are skipped (a million tokens of a 1B model are a thousand
    pieces per layer). The buffers themselves are taken as on a real run."""
    copy = _HostCopy._copy_pieces

    def copy_pieces(self, dev, to_host, non_blocking=False):
        if not (fake_rules.faking() and is_fake(dev)):
            copy(self, dev, to_host, non_blocking)

    with fake_rules.swapped(_HostCopy, _copy_pieces=copy_pieces if run.fewer_iterations else None):
        yield


fake_rules.register("offload copies", rule=_fake_rule)
