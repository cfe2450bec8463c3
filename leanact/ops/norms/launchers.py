"""Kernel or PyTorch path for LayerNorm and RMSNorm (:mod:`.layer_norm`, :mod:`.rms_norm`,
:mod:`.dropout_add_norm`): the launchers of :mod:`.kernels`' one-block-per-row norm kernels.

Same contract as :mod:`leanact.ops.triton.dispatch`: each function returns what the op's PyTorch
path returns, from one kernel, or ``None`` (the caller then runs its PyTorch path):
float16/bfloat16/float32 with a normalized size up to :data:`MAX_N`. The backward's float32 partial
sums of dγ, dβ come from :func:`_grad_outputs`, one row per program (:func:`_programs`; on fake
tensors leanact.estimate sizes them for the CUDA device it models). The kernels launch under the
names ``"layer_norm"``, ``"rms_norm"`` and ``"dropout_add_layer_norm"``, whose self-checks
:mod:`.layer_norm`, :mod:`.rms_norm` and :mod:`.dropout_add_norm` register.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import fake_rules
from ..triton import dispatch as _d

__all__ = ["layer_norm_forward", "layer_norm_backward", "rms_norm_forward", "rms_norm_backward",
           "dropout_add_layer_norm_forward", "dropout_add_layer_norm_backward"]

#: Largest normalized size handled by the one-block-per-row norm kernels (larger: the PyTorch path).
MAX_N = 32768


_SMS: dict[int, int] = {}  # CUDA device index -> multiprocessor count
#: Programs per multiprocessor of LayerNorm's backward (each keeps one partial dγ, dβ row: more
#: programs, more rows in flight and more partials to sum): the fastest count that
#: benchmarks/norm_programs.py finds among 2, 4, 8 and 16 (docs/triton.md, "Measurements behind
#: the kernels' constants").
PROGRAMS_PER_SM = 4
#: The same for RMSNorm's backward (its own fastest count, measured the same way).
RMS_PROGRAMS_PER_SM = 2
#: Programs of the norms' backward when it sums no dγ, dβ partials (γ, β frozen: PEFT / LoRA),
#: each taking an equal share of the rows; None: one program per row, which benchmarks/norm_programs.py
#: times against a fixed count (docs/triton.md, "Measurements behind the kernels' constants").
PROGRAMS_WITHOUT_PARTIALS: int | None = None


#: multiprocessors of the GPU leanact.estimate models, while its rules are in force (fake tensors
#: sit on the CPU: their backward shares its rows as on that GPU)
_MODELLED_SMS: list = [None]


def _programs(rows: int, device: torch.device, per_sm: int | None = None) -> int:
    """Backward programs sharing the rows: ``per_sm`` (default :data:`PROGRAMS_PER_SM`) per SM on
    CUDA (each keeps one partial dγ, dβ row)."""
    sms = 1
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        sms = _SMS.get(index)
        if sms is None:
            sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    elif _MODELLED_SMS[0] is not None and fake_rules.faking():
        sms = _MODELLED_SMS[0]
    return max(1, min(rows, (PROGRAMS_PER_SM if per_sm is None else per_sm) * sms))


@contextlib.contextmanager
def _fake_rule(run):
    """On fake tensors modelling CUDA, the partials of as many programs as the modelled GPU runs."""
    saved = _MODELLED_SMS[0]
    if run.kind == "cuda":
        _MODELLED_SMS[0] = run.sms
    try:
        yield
    finally:
        _MODELLED_SMS[0] = saved


fake_rules.register("norm kernels' partial sums", rule=_fake_rule)


def _grad_outputs(dy: torch.Tensor, t: torch.Tensor, n: int, need_dx, need_dw: bool, need_db: bool,
                  per_sm: int | None = None):
    """dx (dy's dtype) and the float32 partial sums of dγ, dβ (uninitialized: every program writes
    its whole row, zeros where it has no rows), each None where not needed; the partials of both
    are rows of one buffer (one allocation), ``per_sm`` programs' (:func:`_programs`)."""
    k = int(need_dw) + int(need_db)
    p = _programs(t.numel() // n, t.device, per_sm) if k else 0
    parts = torch.empty((k, p, n), dtype=torch.float32, device=t.device) if k else None
    return (torch.empty_like(t, dtype=dy.dtype, memory_format=torch.contiguous_format) if need_dx else None,
            parts[0] if need_dw else None, parts[k - 1] if need_db else None)


def _kernels(k):
    """The norm kernels' launchers standing for ``k`` (what :func:`~leanact.ops.triton.dispatch._usable`
    returned; see :func:`~leanact.ops.triton.dispatch.launchers`)."""
    return _d.launchers(k, "leanact.ops.norms.kernels", "norm_forward")


def _norm_ok(k, x: torch.Tensor, n: int, *params) -> bool:
    return (k is not None and 0 < n <= MAX_N and x.dtype in _d._DTYPES
            and all(t is None or t.dtype in _d._DTYPES for t in params))


def _flat(t):
    """``t`` with its elements in C order (the kernels index the parameters' data flat)."""
    return None if t is None else t.contiguous()


def _stat_shape(x: torch.Tensor, k: int) -> tuple[int, ...]:
    return tuple(x.shape[: x.dim() - k]) + (1,) * k


def _norm_outputs(x: torch.Tensor, n: int):
    """y (x's shape and dtype, contiguous) and rstd (float32, one per row)."""
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty(x.numel() // n, dtype=torch.float32, device=x.device))


def layer_norm_forward(x, shape, weight, bias, eps: float):
    """``(y, rstd)`` as ``torch.native_layer_norm`` returns them (rstd float32 on CUDA; torch's
    CPU op returns x's dtype, mirrored for the interpreter tests), or None."""
    k = _kernels(_d._usable(x, weight, bias))
    n = math.prod(shape)
    if not _norm_ok(k, x, n, weight, bias):
        return None
    y, rstd = _norm_outputs(x, n)
    if _d._launch("layer_norm", x, k.norm_forward, x.contiguous(), y, rstd, n, _flat(weight), _flat(bias), float(eps),
                  rms=False) is _d._FAILED:
        return None
    rstd = rstd.view(_stat_shape(x, len(shape)))
    return y, (rstd.to(x.dtype) if x.device.type == "cpu" and not _d._STATE["fake"] else rstd)


def layer_norm_backward(dy, y, rstd, weight, bias, shape, needs):
    """``(dx, dγ, dβ)`` of LayerNorm from its output (None where not needed), or None."""
    k = _kernels(_d._usable(dy, y, rstd, weight, bias))
    n = math.prod(shape)
    if not _norm_ok(k, y, n, weight, bias) or dy.dtype not in _d._DTYPES:
        return None
    dx, pw, pb = _grad_outputs(dy, y, n, needs[0], weight is not None and needs[1], bias is not None and needs[2])
    w, b = _flat(weight), _flat(bias)
    if _d._launch("layer_norm", y, k.norm_backward, dy.contiguous(), y.contiguous(), rstd.contiguous(), w, b,
                  dx, pw, pb, n, rms=False, from_output=True) is _d._FAILED:
        return None
    grads = _param_grads(k, "layer_norm", y, pw, pb, weight, bias, n, div_w=False)
    return None if grads is None else (dx, *grads)


def dropout_add_layer_norm_forward(h, residual, shape, weight, bias, eps: float, seed, thr: int, scale: float,
                                   z_dtype: torch.dtype, norm_dtype: torch.dtype):
    """``(y, rstd)`` of LayerNorm over z = dropout(h) + residual (z rounded to ``z_dtype``, then
    normalized in ``norm_dtype``, y's dtype; no dropout when ``seed`` is None), from one kernel that
    writes y and rstd only, or None. rstd as ``layer_norm_forward`` returns it."""
    k = _kernels(_d._usable(h, residual, weight, bias, seed))
    n = math.prod(shape)
    if (not _norm_ok(k, h, n, weight, bias) or residual.dtype not in _d._DTYPES or norm_dtype not in _d._DTYPES
            or residual.shape != h.shape or thr >= 1 << 32):
        return None
    y = torch.empty_like(h, dtype=norm_dtype, memory_format=torch.contiguous_format)
    rstd = torch.empty(h.numel() // n, dtype=torch.float32, device=h.device)
    if _d._launch("dropout_add_layer_norm", h, k.norm_forward, h.contiguous(), y, rstd, n, _flat(weight), _flat(bias),
                  float(eps), rms=False, residual=residual.contiguous(),
                  seed=None if seed is None else seed.reshape(()), thr=thr, scale=scale, z_dtype=z_dtype,
                  check_key=(h.dtype, residual.dtype, norm_dtype)) is _d._FAILED:
        return None
    rstd = rstd.view(_stat_shape(h, len(shape)))
    return y, (rstd.to(norm_dtype) if h.device.type == "cpu" and not _d._STATE["fake"] else rstd)


def dropout_add_layer_norm_backward(dy, y, rstd, weight, bias, shape, seed, thr: int, scale: float,
                                    z_dtype: torch.dtype, h_dtype: torch.dtype, r_dtype: torch.dtype, needs):
    """``(dh, dresidual, dγ, dβ)`` of :func:`dropout_add_layer_norm_forward` from its output (None
    where ``needs`` says not needed), from the norm's backward kernel and its partial sums, or None."""
    k = _kernels(_d._usable(dy, y, rstd, weight, bias, seed))
    n = math.prod(shape)
    if (not _norm_ok(k, y, n, weight, bias) or dy.dtype not in _d._DTYPES or h_dtype not in _d._DTYPES
            or r_dtype not in _d._DTYPES):
        return None
    _, pw, pb = _grad_outputs(dy, y, n, False, weight is not None and needs[2], bias is not None and needs[3])
    dr = torch.empty_like(y, dtype=r_dtype, memory_format=torch.contiguous_format) if needs[1] else None
    dh = torch.empty_like(y, dtype=h_dtype, memory_format=torch.contiguous_format) if needs[0] else None
    w, b = _flat(weight), _flat(bias)
    if _d._launch("dropout_add_layer_norm", y, k.norm_backward, dy.contiguous(), y.contiguous(), rstd.contiguous(), w,
                  b, dr, pw, pb, n, rms=False, from_output=True, residual=True, dh=dh,
                  seed=None if seed is None else seed.reshape(()), thr=thr, scale=scale, z_dtype=z_dtype,
                  check_key=(h_dtype, r_dtype, y.dtype)) is _d._FAILED:
        return None
    grads = _param_grads(k, "layer_norm", y, pw, pb, weight, bias, n, div_w=False)  # (the norms' partials sum)
    return None if grads is None else (dh, dr, *grads)


def _param_grads(k, name: str, t, pw, pb, weight, bias, n: int, div_w: bool):
    """(dγ, dβ) in the parameters' dtypes and shapes (None where not needed) from the backward's
    float32 partials, summed by one more kernel (÷ γ when ``div_w``), or None (it failed)."""
    # (no rows: no partials were written, the sums are 0)
    new = torch.empty_like if t.numel() else torch.zeros_like
    dw = None if pw is None else new(weight, memory_format=torch.contiguous_format)
    db = None if pb is None else new(bias, memory_format=torch.contiguous_format)
    if t.numel() and (dw is not None or db is not None) and _d._launch(
            name, t, k.norm_partials_sum, pw, pb, dw, db, _flat(weight) if div_w else None, n, div_w) is _d._FAILED:
        return None
    return dw, db


def rms_norm_forward(x, shape, weight, eps):
    """``(y, rstd)`` as ``torch.ops.aten._fused_rms_norm`` returns them (rstd float32), or None."""
    k = _kernels(_d._usable(x, weight))
    n = math.prod(shape)
    if not _norm_ok(k, x, n, weight):
        return None
    if eps is None:
        eps = torch.finfo(torch.float32).eps  # the compute dtype's (float32 for 16-bit and float32)
    y, rstd = _norm_outputs(x, n)
    if _d._launch("rms_norm", x, k.norm_forward, x.contiguous(), y, rstd, n, _flat(weight), None, float(eps),
                  rms=True) is _d._FAILED:
        return None
    return y, rstd.view(_stat_shape(x, len(shape)))


def rms_norm_backward(dy, t, rstd, weight, n: int, from_output: bool, need_dx: bool, need_dw: bool):
    """``(dx, dγ)`` of RMSNorm (``t`` = y when ``from_output`` else x), or None."""
    k = _kernels(_d._usable(dy, t, rstd, weight))
    if not _norm_ok(k, t, n, weight) or dy.dtype not in _d._DTYPES:
        return None
    dx, pw, _ = _grad_outputs(dy, t, n, need_dx, weight is not None and need_dw, False, RMS_PROGRAMS_PER_SM)
    if _d._launch("rms_norm", t, k.norm_backward, dy.contiguous(), t.contiguous(), rstd.contiguous(), _flat(weight),
                  None, dx, pw, None, n, rms=True, from_output=from_output) is _d._FAILED:
        return None
    grads = _param_grads(k, "rms_norm", t, pw, None, weight, None, n, div_w=from_output)
    return None if grads is None else (dx, grads[0])
