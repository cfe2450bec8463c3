"""Hugging Face RMSNorms (LLaMA's, Gemma's ``(1 + w)``, OLMo 2's, T5's: any class computing one of
them, whatever its name) -> a subclass whose backward keeps only y and one rstd per row.

The variants, as HF writes them (x̂ = x·rsqrt(mean(x²) + eps), computed in fp32):

=========  ==============================================  =======================================
variant    forward                                         where
=========  ==============================================  =======================================
llama      ``w * x̂.to(input dtype)``                       LLaMA, Qwen 2/3 (q/k norms too), Mistral, Mixtral, Phi-3
fp32_mul   ``(w * x̂).to(input dtype)``                     OLMo 2 (also its q/k norms over all heads)
offset     ``(x̂ * (1 + w.float())).type_as(x)``             Gemma 1/2/3 (Gemma 3's q/k norms too)
t5         ``w * x̂`` (x̂ cast to w's dtype if 16-bit)       T5
cohere_ln  ``(w * x̂).to(input dtype)``, x̂ = (x − mean)·rstd Cohere's LayerNorm without bias (w may be
                                                           (heads, d) for its q/k norms)
=========  ==============================================  =======================================

HF's autograd keeps the fp32 copy of x, rstd, x̂ and casts of it. The replacement's *forward is
HF's operations* (the variant's, in the original forward's order, run without autograd), so outputs
are bit-identical in every dtype; only what is kept changes: y (the output, already alive for the next op) and rstd
(fp32, one per row). Backward (fp32, float64 for float64 inputs) with γ = w (``1 + w`` for the
offset variant)::

    x̂ = y/γ,  g = dy·γ,  dx = rstd·(g − x̂·mean(g·x̂)),  dw = Σ_rows dy·x̂,  (g·x̂ = dy·y)

(Cohere's LayerNorm: g − mean(g) in place of g.) On CUDA the backward of every variant with a
one-dimensional weight and the output in the input's dtype runs leanact's RMSNorm kernels (two
launches; γ = 1 + w in fp32 for Gemma's). The forward runs the variant's operations as HF's forward
does, in its order (bitwise its outputs), and keeps the rsqrt they compute: no second pass over x
for rstd (float64 inputs, which HF computes in fp32, take HF's forward and a float64 rstd).

In fp32 this is exact to rounding; in 16-bit dtypes y is x̂·γ rounded once (or x̂ rounded, then
multiplied), so x̂ = y/γ is recovered within 16-bit rounding (gradients within 16-bit tolerance, not
bitwise HF's). When γ cannot be divided by safely (zero or subnormal entries) the input x is kept
instead (x̂ = x·rstd).

Recognised: a module defined in ``transformers.models.*`` with no children, exactly one
Parameter ``weight`` (shape (h,); (heads, d) for Cohere's q/k norms), a float ``variance_epsilon``
or ``eps``, and a ``forward`` whose source is one of the variants above (checked once per class).
A module named ``*RMSNorm`` (or with that state) computing something else is left, with the reason
in the summary.
"""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..ops.backward import once_differentiable
from ..saved import keeping_output
from ..ops.norms.layer_norm import compute_dtype
from ..ops.norms.verdict import confirm_verdicts, from_output_ok
from ..ops.norms.rms_norm import RMSNormFunction
from ..ops.row_chunks import row_slices
from ..ops.transforms import functorch_active
from ..ops.norms import launchers as _triton
from .modules import reclass
from .source import forward_body
from .adapter import ModuleAdapter

__all__ = ["hf_rms_norm_replacement", "is_hf_rms_norm", "VARIANTS", "ADAPTER"]

_HF_BODY = ("input_dtype={x}.dtype;{x}={x}.to(torch.float32);variance={x}.pow(2).mean(-1,keepdim=True);"
            "{x}={x}*torch.rsqrt(variance+self.variance_epsilon);")
#: variant -> normalised forward bodies ({x}: the argument's name); "offset" also checks ``_norm``.
VARIANTS = {
    "llama": (_HF_BODY + "returnself.weight*{x}.to(input_dtype)",),
    "fp32_mul": (_HF_BODY + "return(self.weight*{x}).to(input_dtype)",),
    "offset": ("output=self._norm({x}.float());output=output*(1.0+self.weight.float());returnoutput.type_as({x})",),
    "cohere_ln": ("input_dtype={x}.dtype;{x}={x}.to(torch.float32);mean={x}.mean(-1,keepdim=True);"
                  "variance=({x}-mean).pow(2).mean(-1,keepdim=True);"
                  "{x}=({x}-mean)*torch.rsqrt(variance+self.variance_epsilon);"
                  "{x}=self.weight.to(torch.float32)*{x};return{x}.to(input_dtype)",),
    "t5": ("variance={x}.to(torch.float32).pow(2).mean(-1,keepdim=True);"
           "{x}={x}*torch.rsqrt(variance+self.variance_epsilon);"
           "ifself.weight.dtypein[torch.float16,torch.bfloat16]:;{x}={x}.to(self.weight.dtype);"
           "returnself.weight*{x}",),
}
_OFFSET_NORM = "return{x}*torch.rsqrt({x}.pow(2).mean(-1,keepdim=True)+self.eps)"
_EPS = {"llama": "variance_epsilon", "fp32_mul": "variance_epsilon", "t5": "variance_epsilon", "offset": "eps",
        "cohere_ln": "variance_epsilon"}
_checked: dict[type, tuple[str | None, str | None]] = {}


def _eps_attr(m: nn.Module) -> str | None:
    for k in ("variance_epsilon", "eps"):
        if isinstance(getattr(m, k, None), float):
            return k
    return None


def is_hf_rms_norm(m: nn.Module) -> bool:
    """A transformers module named ``*RMSNorm``, or with an RMSNorm's state (no children, one 1-D
    ``weight``, a float ``variance_epsilon``/``eps``)."""
    t = type(m)
    if not t.__module__.startswith("transformers.models."):
        return False
    if t.__name__.endswith("RMSNorm"):
        return True
    w = m._parameters.get("weight")
    return (not m._modules and set(m._parameters) == {"weight"} and w is not None and w.dim() >= 1
            and _eps_attr(m) is not None)


def _variant(t: type) -> tuple[str | None, str | None]:
    """(variant, None) if ``t.forward`` is one of :data:`VARIANTS`, else (None, reason)."""
    if t not in _checked:
        body = forward_body(t.forward)
        found = None
        if body is not None and len(body[0]) == 1:
            x = body[0][0]
            for name, forms in VARIANTS.items():
                if body[1] in {f.format(x=x) for f in forms}:
                    found = name
            if found == "offset":
                norm = forward_body(getattr(t, "_norm", None))
                if norm is None or len(norm[0]) != 1 or norm[1] != _OFFSET_NORM.format(x=norm[0][0]):
                    found = None
        if found is not None:
            _checked[t] = (found, None)
        elif body is None:
            _checked[t] = (None, "forward source unavailable: cannot check it is a known RMSNorm variant")
        else:
            _checked[t] = (None, "forward is none of the RMSNorm variants leanact knows (LLaMA's w·x̂, OLMo 2's "
                                 "fp32 w·x̂, Gemma's (1 + w)·x̂, T5's)")
    return _checked[t]


# RMSNormFunction's backward as a plain function: dynamo cannot trace one Function's backward
# calling another Function's staticmethod ("Expected FakeBackwardCFunction").
_rms_norm_backward = inspect.unwrap(RMSNormFunction.__dict__["backward"].__func__)


def _gamma(w: torch.Tensor, variant: str, ct: torch.dtype) -> torch.Tensor:
    return (1.0 + w.to(ct)) if variant == "offset" else w.to(ct)


def _variant_backward(ctx, dy, saved):
    """fp32 (float64) formulas of the module doc, for every variant; over chunks of rows when
    the fp32 temporaries would exceed :data:`leanact.ops.row_chunks.CHUNK_BYTES` (dw summed in
    the compute dtype across chunks). ``saved``: ``ctx.saved_tensors``, unpacked once (a
    checkpointed region allows one unpack)."""
    t, rstd, w = saved
    ct = compute_dtype(t.dtype if t.dtype == torch.float64 else dy.dtype)
    k = w.dim()
    t2, dy2 = t.reshape(-1, *t.shape[-k:]), dy.reshape(-1, *t.shape[-k:])
    parts = row_slices(t2.shape[0], t2[0].numel() * torch.finfo(ct).bits // 8)
    if len(parts) == 1:
        dx, dw = _variant_rows(ctx, dy, t, rstd, w, ct)
        return dx, None if dw is None else dw.to(w.dtype)
    r2 = rstd.reshape(t2.shape[0], *rstd.shape[-k:])
    dx = torch.empty(dy2.shape, dtype=ctx.x_dtype, device=dy.device) if ctx.needs_input_grad[0] else None
    dw = None
    for sl in parts:
        dxc, dwc = _variant_rows(ctx, dy2[sl], t2[sl], r2[sl], w, ct)
        if dx is not None:
            dx[sl] = dxc
        if dwc is not None:
            dw = dwc if dw is None else dw.add_(dwc)
    return (None if dx is None else dx.view(dy.shape)), (None if dw is None else dw.to(w.dtype))


def _variant_rows(ctx, dy, t, rstd, w, ct):
    """(dx in x's dtype, dw in the compute dtype) of the rows given."""
    gamma = _gamma(w, ctx.variant, ct)
    dyc, r = dy.to(ct), rstd.to(ct)
    if ctx.from_output:
        yc = t.to(ct)
        xhat, p = yc / gamma, dyc * yc
    else:
        xc = t.to(ct)
        if ctx.variant == "cohere_ln":
            xc = xc - xc.mean(-1, keepdim=True)
        xhat = xc * r
        p = dyc * gamma * xhat
    dx = dw = None
    if ctx.needs_input_grad[0]:
        g = dyc * gamma
        if ctx.variant == "cohere_ln":  # LayerNorm: the mean is subtracted too
            g = g - g.mean(-1, keepdim=True)
        dx = (r * (g - xhat * p.mean(-1, keepdim=True))).to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        dw = (dyc * xhat).reshape(-1, *w.shape).sum(0)
    return dx, dw


def _rstd(x: torch.Tensor, eps: float, variant: str) -> torch.Tensor:
    """rsqrt(mean(x²) + eps) per row (x − mean for Cohere's LayerNorm), in HF's compute dtype (fp32,
    float64 for float64 inputs). On CUDA one pass of torch's fused norm kernel, which returns it (its
    normalized output is dropped); elsewhere, and on torch builds without that kernel, the composite
    (an fp32 copy of x and its square: three passes more)."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        shape = [x.shape[-1]]
        if variant == "cohere_ln":
            return torch.native_layer_norm(x, shape, None, None, eps)[2]
        if hasattr(torch.ops.aten, "_fused_rms_norm"):
            return torch.ops.aten._fused_rms_norm(x, shape, None, eps)[1]
    xf = x.to(compute_dtype(x.dtype))  # HF's fp32 statistics (float64 for float64 inputs)
    if variant == "cohere_ln":
        xf = xf - xf.mean(-1, keepdim=True)
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _llama_rstd(m, x, eps):
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return m.weight * (xf * rstd).to(input_dtype), rstd


def _fp32_mul_rstd(m, x, eps):
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (m.weight * (xf * rstd)).to(input_dtype), rstd


def _offset_rstd(m, x, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((xf * rstd) * (1.0 + m.weight.float())).type_as(x), rstd


def _cohere_ln_rstd(m, x, eps):
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    xc = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (m.weight.to(torch.float32) * (xc * rstd)).to(input_dtype), rstd


def _t5_rstd(m, x, eps):
    rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    xn = x * rstd
    if m.weight.dtype in [torch.float16, torch.bfloat16]:
        xn = xn.to(m.weight.dtype)
    return m.weight * xn, rstd


#: variant -> (module, x, eps) -> (y, rstd): the variant's forward (:data:`VARIANTS`), the same
#: operations in the same order, keeping the rsqrt it computes (bitwise HF's y, and no second pass
#: over x for rstd)
_FORWARD_RSTD = {"llama": _llama_rstd, "fp32_mul": _fp32_mul_rstd, "offset": _offset_rstd,
                 "cohere_ln": _cohere_ln_rstd, "t5": _t5_rstd}


def _forward_rstd(module, x, eps, variant, ref):
    """(y, rstd): HF's forward with the statistic it computes (fp32). float64 inputs (HF computes in
    fp32, the backward in float64) take HF's forward and a float64 rstd (:func:`_rstd`)."""
    if x.dtype == torch.float64:
        return ref(module, x), _rstd(x, eps, variant)
    return _FORWARD_RSTD[variant](module, x, eps)


class _HFRMSNormFunction(torch.autograd.Function):
    """forward: the HF module's operations (bitwise its forward), keeping the rstd they compute; backward:
    the RMSNorm formulas."""

    @staticmethod
    def forward(ctx, x, weight, module, eps, from_output, variant):
        ref = type(module).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        k = weight.dim()
        parts = row_slices(x.numel() // max(1, math.prod(x.shape[-k:])), math.prod(x.shape[-k:]) * 4)
        if len(parts) == 1 or not x.is_contiguous():
            y, rstd = _forward_rstd(module, x, eps, variant, ref)
        else:  # long inputs: HF's forward over chunks of rows (the same values; one chunk's fp32 copies)
            x2 = x.view(-1, *x.shape[-k:])
            y = rstd = None
            for sl in parts:
                yc, rc = _forward_rstd(module, x2[sl], eps, variant, ref)
                if y is None:
                    y, rstd = yc.new_empty((x2.shape[0], *yc.shape[1:])), rc.new_empty((x2.shape[0], *rc.shape[1:]))
                y[sl], rstd[sl] = yc, rc
                del yc, rc
            y, rstd = y.view(*x.shape[:-k], *y.shape[1:]), rstd.view(*x.shape[:-k], *rstd.shape[1:])
        ctx.n, ctx.from_output, ctx.variant, ctx.x_dtype = x.shape[-1], from_output, variant, x.dtype
        ctx.keeps_output = from_output  # read by leanact.ops.amp.keeps_output (recipes under autocast)
        ctx.w_dim = weight.dim()
        ctx.save_for_backward(y if from_output else x, rstd, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        if ctx.from_output:
            confirm_verdicts()
        plain = ctx.w_dim == 1 and dy.dtype == ctx.x_dtype
        if plain and ctx.variant in ("llama", "fp32_mul", "t5"):  # γ = w: leanact's RMSNorm backward
            dx, dw, *_ = _rms_norm_backward(ctx, dy)
            return dx, dw, None, None, None, None
        saved = ctx.saved_tensors
        fused = _offset_kernels(ctx, dy, *saved) if plain and ctx.variant == "offset" else None
        dx, dw = fused if fused is not None else _variant_backward(ctx, dy, saved)
        return dx, dw, None, None, None, None


def _offset_kernels(ctx, dy, t, rstd, w):
    """Gemma's γ = 1 + w through the RMSNorm kernels (CUDA): (dx, dw), or None (the PyTorch path)."""
    gamma = 1.0 + w.to(torch.float32)  # as _gamma: the fp32 γ the forward multiplied by
    fused = _triton.rms_norm_backward(dy, t, rstd, gamma, ctx.n, ctx.from_output, ctx.needs_input_grad[0],
                                      ctx.needs_input_grad[1])
    if fused is None:
        return None
    dx, dw = fused
    return dx, None if dw is None else dw.to(w.dtype)  # dγ/dw = 1


class _LeanHFRMSNorm:
    """Mixin placed before the HF class: ``forward`` keeps y and rstd only.

    ``from_output`` (instance attribute, default None): None = decide from w at each call (a host
    read of w: a graph break under torch.compile); True / False = keep y / keep x, fixed."""

    _leanact_lean = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad)) or functorch_active():
            return type(self).__mro__[2].forward(self, hidden_states)  # (torch.func: leanact.ops.transforms)
        variant = getattr(self, "_leanact_variant", "llama")
        if ((variant == "llama" and w.dtype != torch.float32 and w.dtype != hidden_states.dtype)
                or hidden_states.shape[-w.dim():] != w.shape):
            return type(self).__mro__[2].forward(self, hidden_states)  # mixed precision: HF's promotion
        from_output = getattr(self, "from_output", None)
        if from_output is None:
            # y = γ·x̂ (one rounding in fp32, two in 16-bit): the same conditions as leanact's rms_norm.
            # (w itself, not a view of it: the decision is cached on the tensor's identity)
            out_dtype = hidden_states.dtype if variant in ("offset", "fp32_mul") else \
                torch.promote_types(w.dtype, hidden_states.dtype)
            n = hidden_states.shape[-1]
            # (Gemma's γ = 1 + w: decided on w, in the one batch per optimizer step with the other norms)
            from_output = from_output_ok(w, None, n, out_dtype, math.inf, offset=variant == "offset")
        eps = float(getattr(self, _EPS[variant]))
        # its output (when kept) is the source of autocast's casts (leanact.patching.amp)
        return keeping_output(lambda: _HFRMSNormFunction.apply(hidden_states, w, self, eps, bool(from_output), variant),
                              bool(from_output))


def hf_rms_norm_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's Parameter, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFRMSNorm):
        return None, None
    if set(m._parameters) != {"weight"} or m._buffers or m._modules or m.weight is None or m.weight.dim() < 1:
        return None, f"{t.__name__}: unexpected parameters/buffers (not a norm with one weight)"
    if _eps_attr(m) is None:
        return None, f"{t.__name__}: no float variance_epsilon or eps"
    variant, reason = _variant(t)
    if reason is not None:
        return None, reason
    if not isinstance(getattr(m, _EPS[variant], None), float):
        return None, f"{t.__name__}: no float {_EPS[variant]}"
    return reclass(m, _LeanHFRMSNorm, _leanact_variant=variant), None


ADAPTER = ModuleAdapter("hf_rms_norm", is_hf_rms_norm, hf_rms_norm_replacement,
                        "Hugging Face RMSNorms: LLaMA's, OLMo 2's fp32, Gemma's (1 + w), T5's, "
                        "Cohere's bias-free LayerNorm")
