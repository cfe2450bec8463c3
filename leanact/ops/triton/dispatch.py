"""Kernel or PyTorch path: the dispatch layer under every op's launchers.

Each op's launchers (one function per op and direction, in the op's own folder:
``leanact.ops.<op>.launchers``, e.g. :mod:`leanact.ops.norms.launchers`) return what the op's
PyTorch path would return (same dtypes, shapes and, where the op keeps tensors for backward, the
same tensors to keep), computed by a Triton kernel, or ``None``: the caller then runs its PyTorch
path. They ask :func:`_usable`
and launch through :func:`_launch`. The kernels run when

- ``LEANACT_TRITON`` is unset, ``1`` or ``strict`` (read at every call; ``0`` turns them off),
- every tensor is a plain CUDA tensor (not fake, not a subclass, not a functorch wrapper),
- no ``torch.compile`` trace is running (the PyTorch path is what inductor fuses),
- Triton imports (checked once, by loading :mod:`.common`), and the op's dtype and sizes are
  covered (float16, bfloat16, float32; each launcher says its sizes); otherwise the PyTorch path.

This module imports no op and no kernel module: :mod:`.common` (what every kernel module builds on)
is loaded by name on the first kernel call, each op's kernel module by the name its launchers give
(:func:`launchers`), and each op registers its self-check here (:func:`register_check`).

Before an op's kernel first runs on a device (per op, dtype and variant), a **self-check** runs the
op on small inputs through the kernel and through its PyTorch path on that device and compares them
(bitwise where the math is the same, within the op's documented bound elsewhere; each op registers
its check with :func:`register_check` when its module is imported, with the helpers of
:mod:`.selfcheck`). It runs in a thread of its own, so that no saved-tensor hook, autocast, grad
mode or compile state of the caller's sees it, with its own random generators (the caller's RNG is
not advanced). A kernel that fails to compile or launch, or whose self-check disagrees (e.g. an
untested Triton version or GPU), warns once and leaves its op on the PyTorch path for the rest of
the process; ``LEANACT_TRITON=strict`` raises instead (the tests and the GPU suite set it). While a
CUDA graph is being captured an op not yet checked takes the PyTorch path. Tests run the kernels on
CPU tensors under Triton's interpreter through :func:`use_kernels`.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types
import warnings
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["available", "enabled", "forced", "register_check", "use_kernels", "verified"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Elements per program of the elementwise kernels (a multiple of 8: a program packs whole bytes).
BLOCK = 1024
#: The module every kernel module builds on (rounded stores, exact loads, bit packing), loaded by
#: name on the first kernel call: whether it imports is whether Triton works here.
_KERNELS = "leanact.ops.triton.common"
_STATE: dict = {"kernels": None, "failed": False, "cpu": False, "strict": False, "fake": False, "verify": True}
_BROKEN: set[str] = set()  # kernels that raised or failed their self-check: the PyTorch path from then on
_VERIFIED: set[tuple] = set()  # (op, device, key) whose self-check passed
_PASSED: set[tuple] = set()  # the same entries with the device's index (what each launch looks up)
_CHECKS: dict[str, Callable] = {}  # op name -> check(device, key), raising AssertionError on a mismatch
_CHECK_LOCK = threading.RLock()


class _Local(threading.local):
    force = None  # "on" / "off" inside a self-check's thread (a class default: no AttributeError per lookup)


_LOCAL = _Local()


_LAUNCHERS: dict[str, types.ModuleType] = {}  # kernel module name -> the module (imported once)


def launchers(k, module: str, attr: str):
    """The launchers standing for ``k`` (what :func:`_usable` returned) for an op whose kernels live
    in the module named ``module`` (a dotted name, e.g. ``"leanact.ops.norms.kernels"``): that
    module when ``k`` is a kernel module without ``attr`` (:mod:`.common`, or another op's kernel
    module given to :func:`use_kernels`), None when it fails to import (the PyTorch path); anything
    else (``SHAPES_ONLY``, a test's module or double) as is."""
    if isinstance(k, types.ModuleType) and not hasattr(k, attr):
        found = _LAUNCHERS.get(module)
        if found is None:
            try:
                found = _LAUNCHERS[module] = importlib.import_module(module)
            except Exception:  # a Triton that cannot build these: the PyTorch path
                return None
        return found
    return k


def _kernels():
    """The kernels module (imported once), or None when Triton is missing or fails to import."""
    if _STATE["kernels"] is None and not _STATE["failed"]:
        try:
            kernels = importlib.import_module(_KERNELS)
        except Exception:  # ImportError, or a Triton that cannot initialize on this machine
            _STATE["failed"] = True
        else:
            _STATE["kernels"] = kernels
    return _STATE["kernels"]


def available() -> bool:
    """Whether the kernels can run on this machine (Triton imports and a CUDA device is present)."""
    return torch.cuda.is_available() and _kernels() is not None


_ON, _OFF = ("", "1", "on", "true", "strict"), ("0", "off", "false")


_SETTINGS: dict = {}  # raw LEANACT_TRITON value -> its setting (read at every call, parsed once)
_ENV = os.environ
# the environment's own mapping (what os.environ reads and writes): one dict lookup per op call
# instead of os.environ.get's key encoding and KeyError when the variable is unset
_ENV_DATA, _ENV_KEY = getattr(_ENV, "_data", None), None
if isinstance(_ENV_DATA, dict):
    try:
        _ENV_KEY = _ENV.encodekey("LEANACT_TRITON")
    except Exception:  # noqa: BLE001 - another os.environ: read it the plain way
        _ENV_DATA = None
else:
    _ENV_DATA = None


def _setting() -> str:
    if _ENV_DATA is not None and os.environ is _ENV:
        raw = _ENV_DATA.get(_ENV_KEY)
    else:
        raw = os.environ.get("LEANACT_TRITON")
    value = _SETTINGS.get(raw)
    if value is None:
        value = "" if raw is None else (raw if isinstance(raw, str) else _ENV.decodevalue(raw))
        value = value.strip().lower()
        if value not in _ON + _OFF:
            raise ValueError(f"LEANACT_TRITON={value!r} is not a setting: use 1 (the default: Triton kernels on CUDA), "
                             "0 (the PyTorch path everywhere) or strict (a kernel that fails raises instead of falling "
                             "back)")
        _SETTINGS[raw] = value
    return value


def enabled() -> bool:
    """Whether the kernels may run: ``LEANACT_TRITON`` unset (the default), ``1`` or ``strict``;
    ``0`` turns them off (the PyTorch path everywhere)."""
    return _setting() in _ON


def _strict() -> bool:
    return _STATE["strict"] or _LOCAL.force == "on" or _setting() == "strict"


def register_check(name: str, check: Callable) -> None:
    """Register the self-check of the kernels launched under ``name``: ``check(device, key)`` runs
    the op on small inputs on ``device`` through its kernel and its PyTorch path (see
    :func:`forced`) and raises ``AssertionError`` where they disagree; ``key`` is what the launch
    passed (by default the dtype of the tensor it ran on)."""
    _CHECKS[name] = check


def verified() -> set:
    """The ``(op, device, key)`` whose self-check has passed in this process."""
    return set(_VERIFIED)


@contextlib.contextmanager
def forced(path: str):
    """In this thread, run every op through its kernel (``"on"``: a failing kernel raises, nothing is
    self-checked) or its PyTorch path (``"off"``) -- what a self-check compares."""
    if path not in ("on", "off"):
        raise ValueError(f"forced: path must be 'on' or 'off', got {path!r}")
    saved = _LOCAL.force
    _LOCAL.force = path
    try:
        yield
    finally:
        _LOCAL.force = saved


@contextlib.contextmanager
def use_kernels(module, strict: bool = True, fake: bool = False, verify: bool = False):
    """For the duration of the block, run the kernels: tests pass :mod:`.common` (or an op's kernel
    module, whose launchers then run as they are) imported under ``TRITON_INTERPRET=1`` and CPU
    tensors are accepted; ``fake=True`` accepts fake tensors only (:data:`SHAPES_ONLY`:
    leanact.estimate). ``strict``: a failing kernel or self-check raises. ``verify``: self-check each
    op before its first launch (as on CUDA; off by default, the tests compare the kernels
    themselves)."""
    saved, broken, done = dict(_STATE), set(_BROKEN), set(_VERIFIED)
    _STATE.update(kernels=module, failed=False, cpu=not fake, strict=strict, fake=fake, verify=verify)
    _BROKEN.clear()
    _VERIFIED.clear()
    _PASSED.clear()
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)
        _BROKEN.clear()
        _BROKEN.update(broken)
        _VERIFIED.clear()
        _VERIFIED.update(done)
        _PASSED.clear()


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_functional = torch._is_functional_tensor


def _plain(t: torch.Tensor) -> bool:
    if type(t) in _PLAIN and not _is_functorch_wrapped(t) and not _is_functional(t):
        # not fake: is_fake looks through exactly these wrappers (the per-call common case, kept cheap)
        if _STATE["fake"]:
            return False
    else:
        if is_fake(t):
            return _STATE["fake"]
        if type(t) not in _PLAIN or _STATE["fake"] or _is_functorch_wrapped(t):
            return False
    return t.is_cuda or (_STATE["cpu"] and t.is_cpu)


def _usable(*tensors) -> object:
    """The kernels module when every tensor may run a kernel (see the module doc), else None.
    Called first by every op below: under a torch.compile trace nothing else is looked at."""
    force = _LOCAL.force
    if torch.compiler.is_compiling() or force == "off" or (force is None and not enabled()):
        return None
    for t in tensors:  # (a loop, not all(...): this runs per op call, on the host's critical path)
        if t is not None and not _plain(t):
            return None
    return _kernels()


_FAILED = object()


class _ShapesOnly:
    """Launchers that launch nothing: the ops allocate exactly what they allocate around a real
    kernel (outputs, partial sums). leanact.estimate runs them on fake tensors to model CUDA."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


SHAPES_ONLY = _ShapesOnly()


def _isolated(check: Callable, device: torch.device, key) -> BaseException | None:
    """Run ``check(device, key)`` in a fresh thread (none of this thread's hooks, modes or autocast
    state) and return what it raised, or None."""
    box: dict = {}

    def target():
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with forced("off"):  # its own kernels are forced on by the check where it compares them
                check(device, key)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box["error"] = e

    worker = threading.Thread(target=target, name="leanact-triton-self-check", daemon=True)
    worker.start()
    worker.join()
    return box.get("error")


def _checked(name: str, t: torch.Tensor, key) -> bool:
    """Whether ``name``'s kernel may run on ``t``'s device for ``key``: its self-check there has
    passed (run now if it has not run yet). A failed check warns (raises when strict) and marks the
    op broken."""
    if _LOCAL.force is not None or _STATE["fake"] or not _STATE["verify"]:
        return True
    fast = (name, t.get_device(), key)  # (the device as its index, -1 for the CPU: no str per call)
    if fast in _PASSED:
        return True
    entry = (name, str(t.device), key)
    if entry in _VERIFIED:
        _PASSED.add(fast)
        return True
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # not checked yet: the PyTorch path while a CUDA graph is captured
    with _CHECK_LOCK:
        if entry in _VERIFIED:
            return True
        check = _CHECKS.get(name)
        error = (AssertionError(f"no self-check is registered for {name!r}") if check is None
                 else _isolated(check, t.device, key))
        if error is None:
            _VERIFIED.add(entry)
            return True
        if _strict():
            raise RuntimeError(f"leanact: the Triton kernel of {name} failed its self-check on {t.device} "
                               f"({key}): {type(error).__name__}: {str(error)[:500]}") from error
        _BROKEN.add(name)
        warnings.warn(f"leanact: the Triton kernel of {name} failed its self-check on {t.device} ({key}: "
                      f"{type(error).__name__}: {str(error)[:300]}); {name} uses its PyTorch path from now on "
                      "(LEANACT_TRITON=strict raises instead; please report it)", RuntimeWarning, stacklevel=4)
        return False


def _launch(name: str, t: torch.Tensor, fn, *args, check_key=None, **kwargs):
    """``fn(*args, **kwargs)`` (a launcher of a kernels module) on ``t``'s device (Triton launches
    on the current CUDA device), or :data:`_FAILED` when the kernel raised (compilation or launch:
    nothing written then) or failed its self-check (for ``check_key``, by default ``t.dtype``):
    warned once, and ``name`` takes the PyTorch path from then on. Under ``LEANACT_TRITON=strict``
    it raises."""
    if name in _BROKEN or not _checked(name, t, t.dtype if check_key is None else check_key):
        return _FAILED
    try:
        index = t.get_device()  # (-1 off CUDA)
        if index < 0 or index == torch.cuda.current_device():
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)
    except Exception as e:
        if _strict():
            raise
        _BROKEN.add(name)
        warnings.warn(f"leanact: the Triton kernel of {name} failed ({type(e).__name__}: {str(e)[:300]}); {name} "
                      "uses its PyTorch path from now on (LEANACT_TRITON=strict raises instead)", RuntimeWarning,
                      stacklevel=3)
        return _FAILED
