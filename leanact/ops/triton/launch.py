"""Launching a compiled Triton kernel again, with less host time than ``kernel[grid](...)``.

Every ``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` in Python: it binds and specializes
each argument, builds the cache key's string, compares every global ``tl.constexpr`` the kernel
reads with its value at compile time (the float32 GELU backward reads 27 of them), builds launch
metadata and only then calls the compiled kernel's launcher: several times the host time of the
launch below, which a GPU host's slower cores multiply (``benchmarks/launch_host.py``,
``benchmarks/op_host.py``; docs/triton.md, "Measurements behind the kernels' constants").

:func:`launch` launches the first call of each *specialization* through Triton (which compiles,
checks and launches it) and keeps the compiled kernel it returns; later calls with the same
specialization call that kernel's launcher directly, with the arguments Triton itself passes it
(every parameter in order, constexprs included, defaults filled in). The specialization key is at
least as fine as Triton's: the device, each tensor's dtype and 16-byte alignment, each integer's
value if 1 (Triton makes 1 a constant) else its divisibility by 16 and its width class, the type
of each float, bool and None, and every keyword (constexprs and compile options) by value. What
Triton checks per call and this does not: that a kernel's global constants have not been
reassigned (leanact's are module constants, never reassigned) and Triton's debug knobs (read
when a specialization is first launched).

Triton's own ``kernel[grid]`` runs instead when the kernel is not a compiled ``JITFunction``
(Triton's interpreter: the tests), when a launch hook is installed (a profiler such as Proton; with
none, the launcher gets no metadata and no hooks to call, where Triton builds the metadata and passes
its empty hook chains), for arguments of other types, on ROCm, and with a Triton that has no
``triton.knobs`` or is older than 3.2 (whose launchers take another argument list). If the
launcher rejects the arguments (``TypeError``: nothing was launched), the direct path is turned
off for the process with a warning and the call goes through Triton.
"""
from __future__ import annotations

import inspect
import warnings

import torch

__all__ = ["cdiv", "launch", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b`` (``triton.cdiv``'s value, without its per-call wrapper)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 ≥ ``n`` (``triton.next_power_of_2``'s value for n ≥ 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


#: Keyword arguments of a launch that are compile options, not kernel parameters.
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_cooperative_grid",
                      "launch_pdl", "debug"))
_STATE: dict = {"on": None, "driver": None, "knobs": None, "jit": None}
_COMPILED: dict = {}  # specialization key -> (compiled kernel, the parameters after the positional ones, kernel)
_I32, _I64 = 2 ** 31, 2 ** 63
_TENSOR = torch.Tensor


def _setup() -> bool:
    """Whether the direct path can run here (checked once)."""
    if _STATE["on"] is None:
        on = False
        try:
            import triton
            from triton import knobs
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime import driver
            from triton.runtime.jit import JITFunction

            major, minor = (int(p) for p in triton.__version__.split(".")[:2])
            on = ((major, minor) >= (3, 2) and torch.version.hip is None and hasattr(knobs, "runtime")
                  and hasattr(CompiledKernel, "launch_metadata"))
            _STATE.update(driver=driver, knobs=knobs.runtime, jit=JITFunction)
        except Exception:  # noqa: BLE001 - any other Triton: its own launch path
            on = False
        _STATE["on"] = on
    return _STATE["on"]


def _spec(args: tuple) -> tuple:
    """The specialization key of positional launch arguments (see the module doc); raises
    :class:`_Unkeyed` for an argument of another type. Integers, the most frequent arguments (sizes,
    strides), are tested first and keyed by one small int: 1 itself, else 2 / 4 / 8 for Triton's
    32-bit / 64-bit / unsigned 64-bit parameter plus 1 where 16 divides it (a bool is keyed apart
    from them)."""
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is int:
            add(a if a == 1 else ((a & 15) == 0) + (2 if -_I32 <= a < _I32 else 4 if a < _I64 else 8))
        elif t is _TENSOR or (t is not float and t is not bool and a is not None and isinstance(a, _TENSOR)):
            add(a.dtype)
            add(not (a.data_ptr() & 15))
        elif t is float:
            add(float)
        elif a is None:
            add(None)
        elif t is bool:
            add("true" if a else "false")
        else:
            raise _Unkeyed
    return tuple(key)


class _Unkeyed(Exception):
    """An argument of a type whose specialization is not modelled here."""


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.9's hooks are chains of functions (``calls``),
    empty unless a profiler added one; earlier versions' are a function or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _tail(kernel, args: tuple, kwargs: dict) -> tuple:
    """The values of the kernel's parameters after the positional ``args``: each keyword's, else its
    default (what Triton binds and passes to the launcher)."""
    params = inspect.signature(kernel.fn).parameters
    names = list(params)[len(args):]
    unknown = set(kwargs) - set(names) - _OPTIONS
    if unknown:
        raise TypeError(f"{kernel.__name__}: unknown keyword arguments {sorted(unknown)}")
    return tuple(kwargs[name] if name in kwargs else params[name].default for name in names)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: through Triton the first time for each specialization,
    then by the compiled kernel's launcher (see the module doc). ``grid`` is a tuple of 1 to 3 ints."""
    if not (_STATE["on"] if _STATE["on"] is not None else _setup()) or type(kernel) is not _STATE["jit"]:
        kernel[grid](*args, **kwargs)
        return
    runtime = _STATE["knobs"]
    if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    driver = _STATE["driver"].active
    device = driver.get_current_device()
    try:
        key = (id(kernel), device, _spec(args), tuple(kwargs.items()))  # (a JITFunction hashes its source key)
        hit = _COMPILED.get(key)
    except (_Unkeyed, TypeError):  # an argument of another type, or an unhashable keyword value
        kernel[grid](*args, **kwargs)
        return
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "function"):
            _COMPILED[key] = (compiled, _tail(kernel, args, kwargs), kernel)  # (the kernel kept: its id stays its own)
        return
    compiled, tail, _ = hit
    n = len(grid)
    try:
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.get_current_stream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    except TypeError as e:  # the launcher's argument list is not this one: nothing was launched
        _STATE["on"] = False
        _COMPILED.clear()
        warnings.warn(f"leanact: launching Triton kernels directly failed ({e}); Triton's own launch is used from "
                      "now on (slower on the host; please report it)", RuntimeWarning, stacklevel=2)
        kernel[grid](*args, **kwargs)
