"""LayerNorm whose backward needs only its output y and one rstd per row.

The next Linear keeps y for its weight gradient anyway, so keeping y here costs no new storage
(the meter and the allocator count one storage): the norm's net cost is one rstd per row, instead
of torch's input + mean + rstd. Backward rebuilds the normalized input from the output:

    x̂ = (y − β)/γ,  g = dy·γ,  dx = rstd·(g − mean(g) − x̂·mean(g·x̂)),
    dγ = Σ_rows dy·x̂,  dβ = Σ_rows dy        (means over the normalized dims).

Implementation: x − μ = (y − β)/(γ·rstd) is rebuilt in the compute dtype (fp32 for 16-bit
inputs, fp64 for fp64) and handed, with mean 0 and the saved rstd, to torch's fused
``native_layer_norm_backward``, which then evaluates exactly the formulas above in one kernel
(faster in eager than the same formulas as separate tensor ops; under torch.compile it is
decomposed and fused). Only the backward's temporaries are full-size; nothing extra is kept.

The op keeps y only where y determines x̂ accurately enough: the verdict (:mod:`.verdict`) decides
that from γ and β, caches it and confirms it; elsewhere the op is torch's own layer_norm, which
keeps the input, mean and rstd.

Caveats: the output is saved for backward, so modifying it in place before backward raises (torch's
LayerNorm allows it); double backward raises, naming leanact (``once_differentiable``), on the
from-output path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...saved import keeping_output
from ..amp import no_autocast_backward, norm_inputs
from ..backward import once_differentiable
from ..transforms import functorch_active
from ..triton.dispatch import register_check
from . import launchers as _triton
from .verdict import DEFAULT_MAX_RATIO, confirm_verdicts, from_output_ok

__all__ = ["LayerNormFromOutput", "layer_norm", "backward_from_output", "compute_dtype", "norm_self_check"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32



class LayerNormFromOutput(torch.autograd.Function):
    """LayerNorm that saves (y, rstd) and recovers x̂ = (y − β)/γ in backward (see module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        # torch's own kernel: it returns what this op keeps (y and rstd; the mean is dropped). Only the
        # backward, from the output, is leanact's (one Triton kernel on CUDA)
        y, _mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = normalized_shape
        ctx.save_for_backward(y, rstd, weight, bias)
        ctx.keeps_output = True  # (leanact.ops.amp.keeps_output)
        return y

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, dy):
        # Rebuild x − μ = (y − β)/(γ·rstd) in the compute dtype and hand it, with mean 0 and the
        # saved rstd, to torch's fused LayerNorm backward: it then sees x̂ = (y − β)/γ and computes
        # exactly dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), dγ = Σ dy·x̂, dβ = Σ dy, in one kernel.
        confirm_verdicts()
        y, rstd, w, b = ctx.saved_tensors
        fused = _triton.layer_norm_backward(dy, y, rstd, w, b, ctx.normalized_shape, ctx.needs_input_grad)
        if fused is not None:  # CUDA: one kernel (plus the sum of dγ, dβ partials)
            return (*fused, None, None)
        return (*backward_from_output(dy, y, rstd, w, b, ctx.normalized_shape, ctx.needs_input_grad[:3]), None, None)


def backward_from_output(dy, y, rstd, w, b, normalized_shape, needs) -> tuple:
    """``(dx, dγ, dβ)`` of LayerNorm from its output y and rstd, the PyTorch path (None where
    ``needs`` says not needed, or where γ / β is None): x̂ rebuilt from y, then torch's fused backward."""
    ct = compute_dtype(y.dtype)
    r = rstd.to(ct)
    wc = None if w is None else w.to(ct)
    bc = None if b is None else b.to(ct)
    xc = y.to(ct, copy=True) if bc is None else torch.sub(y, bc)  # a fresh buffer: y stays intact
    if wc is not None:
        xc.div_(wc)
    xc.div_(r)
    mask = [bool(needs[0]), w is not None and bool(needs[1]), b is not None and bool(needs[2])]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy.to(ct), xc, normalized_shape, torch.zeros_like(r), r, wc, bc, mask)
    return (None if dx is None else dx.to(dy.dtype), None if dw is None else dw.to(w.dtype),
            None if db is None else db.to(b.dtype))


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    from_output: bool | None = None,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> torch.Tensor:
    """``F.layer_norm`` (identical output) that keeps only y and rstd for backward.

    from_output: True = recover x̂ from y (caller vouches for γ, β); False = torch's layer_norm,
        which keeps the input; None (default) = decide from γ, β with :func:`from_output_ok`
        (cached; graph-breaks under torch.compile).
    max_ratio: largest |β|/|γ| accepted by the automatic decision (see module doc).
    Without grad (no_grad, eval with frozen inputs) this is plain ``F.layer_norm``, saving nothing;
    under ``torch.func`` transforms it is ``F.layer_norm`` too (:mod:`leanact.ops.transforms`).
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not needs_grad or functorch_active():  # torch.func: torch's own op (leanact.ops.transforms)
        return F.layer_norm(x, shape, weight, bias, eps)
    x, weight, bias = norm_inputs(x, weight, bias)  # autocast's policy for layer_norm (ops.amp)
    if from_output is None:
        from_output = from_output_ok(weight, bias, math.prod(shape), x.dtype, max_ratio)
    if not from_output:
        return F.layer_norm(x, shape, weight, bias, eps)
    # its output is the source of autocast's casts (leanact.patching.amp)
    return keeping_output(lambda: LayerNormFromOutput.apply(x, weight, bias, shape, eps))


# -- the self-checks of the norm kernels ("layer_norm" here, "rms_norm" in .rms_norm) --


def norm_self_check(function, rms: bool):
    """The check of the norm kernels run by ``function`` (:class:`LayerNormFromOutput`, or with
    ``rms`` :class:`leanact.ops.norms.rms_norm.RMSNormFunction`, from output and from input), its key a
    dtype: y and the gradients through the kernels no further from the float64 PyTorch path than
    4x the PyTorch path plus 2 ulp (see :mod:`leanact.ops.triton.selfcheck`)."""
    def check(device: torch.device, key) -> None:
        from ..triton.selfcheck import both, forward_backward, generator, no_worse, randn

        dtype, n = key, 600
        gen = generator(device)
        x = randn((2, 7, n), device, dtype, gen, 2.0)
        w = (torch.rand(n, generator=gen, device=device) + 0.5).to(dtype)
        b = randn(n, device, dtype, gen, 0.1)
        dy = randn((2, 7, n), device, dtype, gen)
        for from_output in ((True, False) if rms else (True,)):
            def run(x=x, w=w, b=b, dy=dy):
                if rms:
                    y, grads = forward_backward(function, (x, w, (n,), None, from_output), dy,
                                                (True, True, False, False, False))
                else:
                    y, grads = forward_backward(function, (x, w, b, (n,), 1e-5), dy, (True, True, True, False, False))
                return [y, *grads[: 2 if rms else 3]]

            got, ref = both(run)
            truth = run(*(t.double() for t in (x, w, b, dy)))  # float64: the PyTorch path
            name = "RMSNorm" if rms else "LayerNorm"
            for what, a, r, t in zip(("y", "dx", "dweight", "dbias"), got, ref, truth):
                no_worse(f"{name} (from output: {from_output}) {what}", a, r, t)
    return check


register_check("layer_norm", norm_self_check(LayerNormFromOutput, rms=False))
