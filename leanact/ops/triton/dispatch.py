"""Kernel or PyTorch path: one function per op and direction.

Each function returns what the op's PyTorch path would return (same dtypes, shapes and, where
the op keeps tensors for backward, the same tensors to keep), computed by a Triton kernel, or
``None``: the caller then runs its PyTorch path. The kernels run when

- ``LEANACT_TRITON`` is unset, ``1`` or ``strict`` (read at every call; ``0`` turns them off),
- every tensor is a plain CUDA tensor (not fake, not a subclass, not a functorch wrapper),
- no ``torch.compile`` trace is running (the PyTorch path is what inductor fuses),
- Triton imports (checked once), and the op's dtype and sizes are covered (float16, bfloat16,
  float32; normalized size up to :data:`MAX_N`); otherwise the PyTorch path.

Before an op's kernel first runs on a device (per op, dtype and variant), a **self-check** runs
the op on small inputs through the kernel and through its PyTorch path on that device and compares
them (bitwise where the math is the same, within the op's documented bound elsewhere; checks are
registered with :func:`register_check`, those of the ops in :mod:`.selfcheck`). It runs in a
thread of its own, so that no saved-tensor hook, autocast, grad mode or compile state of the
caller's sees it, with its own random generators (the caller's RNG is not advanced). A kernel that
fails to compile or launch, or whose self-check disagrees (e.g. an untested Triton version or GPU),
warns once and leaves its op on the PyTorch path for the rest of the process;
``LEANACT_TRITON=strict`` raises instead (the tests and the GPU suite set it). While a CUDA graph
is being captured an op not yet checked takes the PyTorch path. Tests run the kernels on CPU
tensors under Triton's interpreter through :func:`use_kernels`.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["available", "enabled", "use_kernels", "register_check", "verified", "dropout", "keep_mask_like", "keep_mask_rows", "layer_norm_forward",
           "layer_norm_backward", "rms_norm_forward", "rms_norm_backward", "gelu_forward", "gelu_backward"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Elements per program of the elementwise kernels (a multiple of 8: a program packs whole bytes).
BLOCK = 1024
#: Largest normalized size handled by the one-block-per-row norm kernels (larger: the PyTorch path).
MAX_N = 32768
_STATE: dict = {"kernels": None, "failed": False, "cpu": False, "strict": False, "fake": False, "verify": True}
_BROKEN: set[str] = set()  # kernels that raised or failed their self-check: the PyTorch path from then on
_VERIFIED: set[tuple] = set()  # (op, device, key) whose self-check passed
_CHECKS: dict[str, Callable] = {}  # op name -> check(device, key), raising AssertionError on a mismatch
_CHECK_LOCK = threading.RLock()
_LOCAL = threading.local()  # .force: "on" / "off" inside a self-check's thread


def _kernels():
    """The kernels module (imported once), or None when Triton is missing or fails to import."""
    if _STATE["kernels"] is None and not _STATE["failed"]:
        try:
            from . import kernels
        except Exception:  # ImportError, or a Triton that cannot initialize on this machine
            _STATE["failed"] = True
        else:
            _STATE["kernels"] = kernels
    return _STATE["kernels"]


def available() -> bool:
    """Whether the kernels can run on this machine (Triton imports and a CUDA device is present)."""
    return torch.cuda.is_available() and _kernels() is not None


_ON, _OFF = ("", "1", "on", "true", "strict"), ("0", "off", "false")


def _setting() -> str:
    value = os.environ.get("LEANACT_TRITON", "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"LEANACT_TRITON={value!r} is not a setting: use 1 (the default: Triton kernels on CUDA), "
                         "0 (the PyTorch path everywhere) or strict (a kernel that fails raises instead of falling "
                         "back)")
    return value


def enabled() -> bool:
    """Whether the kernels may run: ``LEANACT_TRITON`` unset (the default), ``1`` or ``strict``;
    ``0`` turns them off (the PyTorch path everywhere)."""
    return _setting() in _ON


def _strict() -> bool:
    return _STATE["strict"] or getattr(_LOCAL, "force", None) == "on" or _setting() == "strict"


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
    saved = getattr(_LOCAL, "force", None)
    _LOCAL.force = path
    try:
        yield
    finally:
        _LOCAL.force = saved


@contextlib.contextmanager
def use_kernels(module, strict: bool = True, fake: bool = False, verify: bool = False):
    """For the duration of the block, run ``module``'s launchers: tests pass :mod:`.kernels`
    imported under ``TRITON_INTERPRET=1`` and CPU tensors are accepted; ``fake=True`` accepts fake
    tensors only (:data:`SHAPES_ONLY`: leanact.estimate). ``strict``: a failing kernel or self-check
    raises. ``verify``: self-check each op before its first launch (as on CUDA; off by default, the
    tests compare the kernels themselves)."""
    saved, broken, done = dict(_STATE), set(_BROKEN), set(_VERIFIED)
    _STATE.update(kernels=module, failed=False, cpu=not fake, strict=strict, fake=fake, verify=verify)
    _BROKEN.clear()
    _VERIFIED.clear()
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)
        _BROKEN.clear()
        _BROKEN.update(broken)
        _VERIFIED.clear()
        _VERIFIED.update(done)


def _plain(t: torch.Tensor) -> bool:
    if is_fake(t):
        return _STATE["fake"]
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or _STATE["fake"]:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    dev = t.device.type
    return dev == "cuda" or (dev == "cpu" and _STATE["cpu"])


def _usable(*tensors) -> object:
    """The kernels module when every tensor may run a kernel (see the module doc), else None.
    Called first by every op below: under a torch.compile trace nothing else is looked at."""
    force = getattr(_LOCAL, "force", None)
    if torch.compiler.is_compiling() or force == "off" or (force is None and not enabled()):
        return None
    if not all(t is None or _plain(t) for t in tensors):
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
    if getattr(_LOCAL, "force", None) is not None or _STATE["fake"] or not _STATE["verify"]:
        return True
    entry = (name, str(t.device), key)
    if entry in _VERIFIED:
        return True
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # not checked yet: the PyTorch path while a CUDA graph is captured
    with _CHECK_LOCK:
        if entry in _VERIFIED:
            return True
        if name not in _CHECKS:
            from . import selfcheck  # noqa: F401  (registers the ops' checks)
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
    """``fn(*args, **kwargs)`` (a launcher of :mod:`.kernels`) on ``t``'s device (Triton launches
    on the current CUDA device), or :data:`_FAILED` when the kernel raised (compilation or launch:
    nothing written then) or failed its self-check (for ``check_key``, by default ``t.dtype``):
    warned once, and ``name`` takes the PyTorch path from then on. Under ``LEANACT_TRITON=strict``
    it raises."""
    if name in _BROKEN or not _checked(name, t, t.dtype if check_key is None else check_key):
        return _FAILED
    try:
        with torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext():
            return fn(*args, **kwargs)
    except Exception as e:
        if _strict():
            raise
        _BROKEN.add(name)
        warnings.warn(f"leanact: the Triton kernel of {name} failed ({type(e).__name__}: {str(e)[:300]}); {name} "
                      "uses its PyTorch path from now on (LEANACT_TRITON=strict raises instead)", RuntimeWarning,
                      stacklevel=3)
        return _FAILED


# -- dropout ---------------------------------------------------------------------------------------


def dropout(x: torch.Tensor, seed: torch.Tensor, p: float, inplace: bool):
    """``x * keep_mask_like(seed, x.shape, p) / (1 - p)`` (into x when ``inplace``), or None."""
    k = _usable(x, seed)
    if k is None or x.dtype not in _DTYPES:
        return None
    from ..random import keep_threshold

    thr = keep_threshold(p)
    if thr >= 1 << 32:
        return None
    scale = 1.0 / (1.0 - p)
    src = x if x.is_contiguous() else x.contiguous()
    out = src if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if _launch("dropout", x, k.dropout_apply, src, out, seed.reshape(()), thr, scale) is _FAILED:
        return None
    return x.copy_(out) if inplace and out is not x else out


def keep_mask_like(seed: torch.Tensor, shape, p: float, device: torch.device, offset: int):
    """The bool keep-mask of a ``shape`` tensor whose element j has index ``offset + j``, or None."""
    k = _usable(seed)
    if k is None or seed.device != device:
        return None
    from ..random import keep_threshold

    thr = keep_threshold(p)
    if thr >= 1 << 32:
        return None
    out = torch.empty(tuple(shape), dtype=torch.bool, device=device)
    if out.numel() and _launch("dropout", seed, k.keep_mask_range, seed.reshape(()), out, thr, offset) is _FAILED:
        return None
    return out


def keep_mask_rows(seed: torch.Tensor, starts: torch.Tensor, length: int, p: float):
    """``keep_mask(seed, starts[:, None] + arange(length), p)`` (bool (rows, length)), or None."""
    k = _usable(seed, starts)
    if k is None or starts.dim() != 1 or starts.device != seed.device or length >= 65535 * BLOCK:
        return None
    from ..random import keep_threshold

    thr = keep_threshold(p)
    if thr >= 1 << 32:
        return None
    out = torch.empty((starts.numel(), length), dtype=torch.bool, device=seed.device)
    if out.numel() and _launch("dropout", seed, k.keep_mask_rows, seed.reshape(()), starts.to(torch.int64).contiguous(),
                               out, thr) is _FAILED:
        return None
    return out


# -- LayerNorm / RMSNorm ---------------------------------------------------------------------------


def _norm_ok(k, x: torch.Tensor, n: int, *params) -> bool:
    return (k is not None and 0 < n <= MAX_N and x.dtype in _DTYPES
            and all(t is None or t.dtype in _DTYPES for t in params))


def _flat(t):
    return None if t is None else t.contiguous().reshape(-1)


def _stat_shape(x: torch.Tensor, k: int) -> tuple[int, ...]:
    return tuple(x.shape[: x.dim() - k]) + (1,) * k


def _norm_outputs(x: torch.Tensor, n: int):
    """y (x's shape and dtype, contiguous) and rstd (float32, one per row)."""
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.numel() // n, dtype=torch.float32, device=x.device))


def _programs(rows: int, device: torch.device) -> int:
    """Backward programs sharing the rows: 4 per SM on CUDA (each keeps one partial dγ, dβ row)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(rows, 4 * sms))


def _grad_outputs(dy: torch.Tensor, t: torch.Tensor, n: int, need_dx, need_dw: bool, need_db: bool):
    """dx (dy's dtype) and the zeroed float32 partial sums of dγ, dβ, each None where not needed."""
    p = _programs(t.numel() // n, t.device)
    dev = t.device
    return (torch.empty(t.shape, dtype=dy.dtype, device=dev) if need_dx else None,
            torch.zeros((p, n), dtype=torch.float32, device=dev) if need_dw else None,
            torch.zeros((p, n), dtype=torch.float32, device=dev) if need_db else None)


def layer_norm_forward(x, shape, weight, bias, eps: float):
    """``(y, rstd)`` as ``torch.native_layer_norm`` returns them (rstd float32 on CUDA; torch's
    CPU op returns x's dtype, mirrored for the interpreter tests), or None."""
    k = _usable(x, weight, bias)
    n = math.prod(shape)
    if not _norm_ok(k, x, n, weight, bias):
        return None
    y, rstd = _norm_outputs(x, n)
    if _launch("layer_norm", x, k.norm_forward, x.contiguous(), y, rstd, n, _flat(weight), _flat(bias), float(eps),
               rms=False) is _FAILED:
        return None
    rstd = rstd.view(_stat_shape(x, len(shape)))
    return y, (rstd.to(x.dtype) if x.device.type == "cpu" and not _STATE["fake"] else rstd)


def layer_norm_backward(dy, y, rstd, weight, bias, shape, needs):
    """``(dx, dγ, dβ)`` of LayerNorm from its output (None where not needed), or None."""
    k = _usable(dy, y, rstd, weight, bias)
    n = math.prod(shape)
    if not _norm_ok(k, y, n, weight, bias) or dy.dtype not in _DTYPES:
        return None
    dx, dw, db = _grad_outputs(dy, y, n, needs[0], weight is not None and needs[1], bias is not None and needs[2])
    if _launch("layer_norm", y, k.norm_backward, dy.contiguous(), y.contiguous(), rstd.contiguous(), _flat(weight),
               _flat(bias), dx, dw, db, n, rms=False, from_output=True) is _FAILED:
        return None
    dw = None if dw is None else dw.sum(0).to(weight.dtype).view(weight.shape)
    db = None if db is None else db.sum(0).to(bias.dtype).view(bias.shape)
    return dx, dw, db


def rms_norm_forward(x, shape, weight, eps):
    """``(y, rstd)`` as ``torch.ops.aten._fused_rms_norm`` returns them (rstd float32), or None."""
    k = _usable(x, weight)
    n = math.prod(shape)
    if not _norm_ok(k, x, n, weight):
        return None
    if eps is None:
        eps = torch.finfo(torch.float32).eps  # the compute dtype's (float32 for 16-bit and float32)
    y, rstd = _norm_outputs(x, n)
    if _launch("rms_norm", x, k.norm_forward, x.contiguous(), y, rstd, n, _flat(weight), None, float(eps),
               rms=True) is _FAILED:
        return None
    return y, rstd.view(_stat_shape(x, len(shape)))


def rms_norm_backward(dy, t, rstd, weight, n: int, from_output: bool, need_dx: bool, need_dw: bool):
    """``(dx, dγ)`` of RMSNorm (``t`` = y when ``from_output`` else x), or None."""
    k = _usable(dy, t, rstd, weight)
    if not _norm_ok(k, t, n, weight) or dy.dtype not in _DTYPES:
        return None
    dx, dw, _ = _grad_outputs(dy, t, n, need_dx, weight is not None and need_dw, False)
    if _launch("rms_norm", t, k.norm_backward, dy.contiguous(), t.contiguous(), rstd.contiguous(), _flat(weight), None,
               dx, dw, None, n, rms=True, from_output=from_output) is _FAILED:
        return None
    if dw is not None:
        dw = dw.sum(0)
        if from_output:
            dw = dw / _flat(weight).to(torch.float32)
        dw = dw.to(weight.dtype).view(weight.shape)
    return dx, dw


# -- GELU ------------------------------------------------------------------------------------------


def gelu_forward(x: torch.Tensor, approximate: str, with_bits: bool):
    """``(y, packed bits of x > x* or None)`` as ``leanact.ops.gelu.function._forward``, or None."""
    k = _usable(x)
    if k is None or x.dtype not in _DTYPES:
        return None
    from ..gelu import minimum, tables

    n = x.numel()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device) if with_bits else None
    if x.dtype == torch.float32:
        r = _launch("gelu", x, k.gelu_forward32, x.contiguous(), y, bits, minimum._THRESHOLDS[torch.float32][approximate][0],
                    approximate == "tanh", check_key=(x.dtype, approximate))
    else:
        table = tables._ACCESSORS["y16", tables._dtype_name(x.dtype), approximate](str(x.device))
        r = _launch("gelu", x, k.gelu_forward16, x.contiguous(), y, bits, table,
                    minimum._THRESHOLDS[x.dtype][approximate][1], check_key=(x.dtype, approximate))
    return None if r is _FAILED else (y, bits)


def gelu_backward(y: torch.Tensor, bits: torch.Tensor, dy: torch.Tensor, approximate: str):
    """``dy * GELU'(x)`` rebuilt from y and the packed bits, as ``leanact.ops.gelu.function._backward``, or None."""
    k = _usable(y, bits, dy)
    if k is None or y.dtype not in _DTYPES or dy.dtype != y.dtype:
        return None
    from ..gelu import rebuild32, tables

    dev = str(y.device)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if y.dtype == torch.float32:
        ab = tables._ACCESSORS["ab32", "float32", approximate](dev)
        h = tables._ACCESSORS["h32", "float32", approximate](dev)
        r = _launch("gelu", y, k.gelu_backward32, y.contiguous(), bits, dy.contiguous(), out, ab, h,
                    rebuild32._C32[approximate],
                    approximate == "tanh", check_key=(y.dtype, approximate))
    else:
        table = tables._ACCESSORS["g16", tables._dtype_name(y.dtype), approximate](dev)
        r = _launch("gelu", y, k.gelu_backward16, y.contiguous(), bits, dy.contiguous(), out, table,
                    check_key=(y.dtype, approximate))
    return None if r is _FAILED else out
