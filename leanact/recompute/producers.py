"""Producer ops: exact ops that keep their input and register a recipe for their output.

Each keeps, for its own backward, exactly what torch's standard derivative needs from the INPUT
side (never its output), computes forward and backward with torch's own kernels (outputs and
gradients bitwise equal to the plain torch op), and, while a
:class:`~leanact.recompute.recipes.RecipeTransform` is active, registers its output's recipe so a
consumer (a Linear) keeps nothing extra for it:

====================  =====================================  =================================
producer              kept for its own backward              output rebuilt (recipe) from
====================  =====================================  =================================
layer_norm            x, mean, rstd (+ γ, β)                  x, γ, β (``native_layer_norm``)
rms_norm              x, rstd (+ γ)                          x, γ (``_fused_rms_norm``)
gelu / silu / relu    x                                      x
quick_gelu            x                                      x: ``x * sigmoid(1.702 * x)``
swiglu                a, b (views of one tensor if fused)    a, b: ``silu(a) * b``
dropout               the seed (8 bytes)                     (x or x's recipe, seed)
====================  =====================================  =================================

Norm backward is ``native_layer_norm_backward`` (LayerNorm) or the standard formulas (RMSNorm)
from x and the statistics (never divides by γ). Outside a transform these are ordinary exact ops;
without grad they are the plain torch functions and keep nothing. All backward formulas are differentiable
(double backward works).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd import Function

from leanact.ops.amp import norm_inputs
from leanact.ops.dropout.function import dropout_seeded
from leanact.ops.random import draw_seed
from leanact.ops.transforms import functorch_active
from leanact.ops.gated_mlp import launchers as _gated
from leanact.saved import with_ambient

from .recipes import register, release

__all__ = ["layer_norm", "rms_norm", "activation", "gelu", "silu", "relu", "quick_gelu", "swiglu", "dropout", "cast",
           "ACTIVATIONS"]

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "quick_gelu")


def _in_ambient(fn):
    """Run the producer with this thread's ambient transform active (:func:`leanact.saved.with_ambient`:
    the autocast recipes of a patched model), so that it registers its recipe and what it keeps
    counts as kept for the recipes of its consumers."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with with_ambient():
            return fn(*args, **kwargs)

    return wrapper


def _needs_grad(*ts) -> bool:
    """Whether the lean (custom Function) path runs; under torch.func transforms the plain torch
    ops run instead (:mod:`leanact.ops.transforms`)."""
    return (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)
            and not functorch_active())


def _shape(normalized_shape) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


# -- norms ---------------------------------------------------------------------------------------

class _LayerNorm(Function):
    """LayerNorm keeping (x, mean, rstd); torch's ``native_layer_norm`` forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.shape = shape
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        release(ctx)
        x, mean, rstd, w, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], w is not None and need[1], b is not None and need[2]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, list(ctx.shape), mean, rstd, w, b, mask)
        return dx, dw, db, None, None


@_in_ambient
def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` (bitwise: output and gradients) keeping x, mean, rstd; output by recipe."""
    shape = _shape(normalized_shape)
    if not _needs_grad(x, weight, bias):
        return F.layer_norm(x, shape, weight, bias, eps)
    x, weight, bias = norm_inputs(x, weight, bias)
    y = _LayerNorm.apply(x, weight, bias, shape, eps)
    register(y, "layer_norm", lambda x, w, b: torch.native_layer_norm(x, shape, w, b, eps)[0], x, weight, bias)
    return y


def _fused_rms(x, shape, weight, eps):
    return torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)


class _RMSNorm(Function):
    """RMSNorm keeping (x, rstd); forward ``_fused_rms_norm`` (bitwise ``F.rms_norm``), backward
    the standard formulas in the compute dtype (fp32 for 16-bit inputs)::

        x̂ = x·rstd,  g = dy·γ,  dx = rstd·(g − x̂·mean(g·x̂)),  dγ = Σ_rows dy·x̂
    """

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        y, rstd = _fused_rms(x, shape, weight, eps)
        ctx.shape = shape
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        release(ctx)
        x, rstd, w = ctx.saved_tensors
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        dims = tuple(range(-len(ctx.shape), 0))
        xhat = x.to(ct) * rstd.to(ct)
        dyc = dy.to(ct)
        g = dyc if w is None else dyc * w.to(ct)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (rstd.to(ct) * (g - xhat * (g * xhat).mean(dims, keepdim=True))).to(x.dtype)
        if w is not None and ctx.needs_input_grad[1]:
            dw = (dyc * xhat).sum(tuple(range(x.dim() - len(ctx.shape)))).to(w.dtype)
        return dx, dw, None, None


@_in_ambient
def rms_norm(x, normalized_shape, weight=None, eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` (bitwise output; standard exact gradients) keeping x, rstd."""
    shape = _shape(normalized_shape)
    if not _needs_grad(x, weight):
        return F.rms_norm(x, shape, weight, eps)
    x, weight = norm_inputs(x, weight)
    y = _RMSNorm.apply(x, weight, shape, eps)
    register(y, "rms_norm", lambda x, w: _fused_rms(x, shape, w, eps)[0], x, weight)
    return y


# -- activations ---------------------------------------------------------------------------------

def _act(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "silu":
        return F.silu(x)
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)  # Hugging Face's QuickGELUActivation, op for op
    return F.relu(x)


def _silu_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():  # double backward: a differentiable form (as torch's own silu)
        s = torch.sigmoid(x)
        return dy * s * (1 + x * (1 - s))
    return torch.ops.aten.silu_backward(dy, x)


def _act_grad(kind: str, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    if kind == "gelu":
        return aten.gelu_backward(dy, x)
    if kind == "gelu_tanh":
        return aten.gelu_backward(dy, x, approximate="tanh")
    if kind == "silu":
        return _silu_grad(dy, x)
    if kind == "quick_gelu":  # autograd's steps for x * sigmoid(1.702 x), in its order: bitwise its gradient
        s = torch.sigmoid(1.702 * x)
        return dy * s + aten.sigmoid_backward(dy * x, s) * 1.702
    return aten.threshold_backward(dy, x, 0)  # x > 0 exactly where relu(x) > 0


class _Activation(Function):
    """Elementwise activation keeping its input x (torch's derivative kernels from x)."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.kind = kind
        ctx.save_for_backward(x)
        return _act(kind, x)

    @staticmethod
    def backward(ctx, dy):
        release(ctx)
        (x,) = ctx.saved_tensors
        return _act_grad(ctx.kind, dy, x), None


@_in_ambient
def activation(x: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """``kind`` in :data:`ACTIVATIONS`; keeps x, output by recipe (bitwise equal to torch's)."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")
    if not _needs_grad(x):
        return _act(kind, x)
    y = _Activation.apply(x, kind)
    register(y, kind, lambda x: _act(kind, x), x)
    return y


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate)`` keeping x; output by recipe."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return activation(x, "gelu" if approximate == "none" else "gelu_tanh")


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` keeping x; output by recipe."""
    return activation(x, "silu")


def relu(x: torch.Tensor) -> torch.Tensor:
    """``F.relu(x)`` keeping x; output by recipe."""
    return activation(x, "relu")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(1.702 * x)`` (Hugging Face's ``QuickGELUActivation``, CLIP) keeping x
    (autograd keeps x, the sigmoid and, in the next Linear, the output); output by recipe."""
    return activation(x, "quick_gelu")


def _swiglu(a, b):
    """silu(a)·b: the gated-MLP kernel on CUDA (:mod:`leanact.ops.gated_mlp.launchers`), else torch's two
    ops. The recipe rebuilds through this function too, so the rebuilt output is the forward's."""
    y = _gated.glu_forward(a, b, "silu")
    return F.silu(a) * b if y is None else y


class _SwiGLU(Function):
    """silu(a)·b keeping a and b; gradients as torch's mul + silu composition (bitwise), or, on CUDA
    with the kernels on, one gated-MLP kernel per direction (within the bound of docs/triton.md)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _swiglu(a, b)

    @staticmethod
    def backward(ctx, dy):
        release(ctx)
        a, b = ctx.saved_tensors
        da = db = None
        if not torch.is_grad_enabled():  # (double backward: torch's differentiable ops below)
            out = _gated.glu_backward(a, b, dy, "silu", ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
            if out is not None:
                return out[0], out[1]
        if ctx.needs_input_grad[1]:
            db = dy * F.silu(a)
        if ctx.needs_input_grad[0]:
            da = _silu_grad(dy * b, a)
        return da, db


@_in_ambient
def swiglu(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(a) * b``; with ``b=None``, ``a`` is the fused projection ``[gate | up]`` (split in
    halves along the last dim). Keeps a and b (one storage when fused); output by recipe."""
    if b is None:
        a, b = a.chunk(2, dim=-1)
    if not _needs_grad(a, b):
        return _swiglu(a, b)
    y = _SwiGLU.apply(a, b)
    register(y, "swiglu", _swiglu, a, b)
    return y


# -- dropout -------------------------------------------------------------------------------------

@_in_ambient
def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, seed: torch.Tensor | int | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Seeded dropout (``leanact.ops.dropout.function.dropout_seeded``: keeps only the seed); the output's
    recipe is (x, seed), where x is referenced through its own recipe when it has one.

    ``seed=None`` draws one from ``generator`` (default generator of x's device). Identity when
    ``not training`` or ``p == 0``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0 or x.numel() == 0:
        return x
    if p == 1.0:
        return x * 0.0
    if seed is None:
        seed = draw_seed(x.device, generator)
    elif isinstance(seed, int):
        seed = torch.tensor(seed, dtype=torch.int64, device=x.device)
    elif seed.dim() != 0 or seed.device != x.device:
        seed = seed.reshape(()).to(x.device)
    p = float(p)
    y = dropout_seeded(x, seed, p)
    if y.requires_grad:
        register(y, "dropout", lambda x, s: dropout_seeded(x, s, p), x, seed)
    return y


# -- cast ----------------------------------------------------------------------------------------

@_in_ambient
def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` whose output is a recipe (x or x's recipe): e.g. a norm output cast to the
    autocast dtype before a Linear, so the Linear keeps nothing for it (autocast's own cast, done
    inside the Linear, is a new tensor no recipe describes). Keeps nothing itself. Use one cast per
    consumer, as autocast does, so their gradients are summed in x's dtype, not the lower one."""
    if x.dtype == dtype:
        return x
    y = x.to(dtype)
    if y.requires_grad:
        register(y, "cast", lambda x: x.to(dtype), x)
    return y
