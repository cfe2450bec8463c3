"""Exact memory-lean GELU: keep the output and one bit per element, rebuild the gradient.

Tempo (arXiv 2210.10246) observed that the layer after a GELU keeps the GELU's output ``y``
anyway, so a GELU that keeps ``y`` (instead of its input ``x``) costs almost nothing extra. GELU
is not monotone, so ``y`` alone does not determine ``x``: one bit per element says on which side
of the minimum ``x*`` (``GELU'(x*) = 0``) the input was. Tempo rebuilt ``GELU'(x)`` from ``y``
with polynomial fits; here backward *solves* ``GELU(x) = y`` on the stored branch (no
data-dependent control flow, so it traces under ``torch.compile``), then evaluates the exact
derivative:

- 16-bit storage (bfloat16, float16): the derivative is a function of the 16-bit pattern of ``y``
  and the bit, 2 x 65536 values. They are computed once (per dtype, mode and device, lazily, with
  the exact rebuild below: ``_grad_from_output``) into a 512 KiB float32 table; backward is a
  gather and the product with the incoming gradient, rounded once, bitwise what the exact rebuild
  gives for every input. The forward is a 65536-entry table of GELU as well (bitwise the float32
  working-precision forward).
- float32 storage: an initial guess for ``x`` from a table (a key computed from ``y`` picks one of
  2**17 cells; linear interpolation in the cell; error ~1e-7), then one float64 step of third
  order (``f'(x0 + q) = f' + q f'' + q**2 h``, ``q = (y - f)/f'``, ``h`` from the table), so one
  float64 ``erfc`` and ``exp`` (tanh: one ``exp``) per element.
- float64 storage: safeguarded Halley steps from asymptotic initial guesses, with compensated
  arithmetic (below).

On CUDA the 16-bit and float32 paths run Triton kernels (:mod:`leanact.ops.gelu.launchers`): the
16-bit ones read the same tables (bitwise); the float32 ones do the float32 path's work in float32
arithmetic from two 64-128 KiB tables of cubics, within a few ulps of it (``docs/gelu_bound.md``,
section 8).

Kept for backward: ``y`` (``ctx.save_for_backward``, so modifying it in place afterwards makes
backward raise) and ``ceil(numel / 8)`` bytes of packed branch bits. ``x`` is not kept.

Precision (derivation in ``docs/gelu_bound.md``). The stored ``y`` is ``GELU(x)`` rounded, so
the true output lies within half an ulp of it and the best any output-based rebuild can return is
a derivative between the extremes of ``GELU'`` over those outputs. Next to the minimum the
inverse has a square-root branch point and that interval is wide: about
``sqrt(2 GELU''(x*) ulp(y*)/2)``, 8e-5 for float32, 2e-2 for bfloat16. This rebuild stays within
that interval plus the final rounding (float64: plus ~3 ulps) everywhere. To get there it works
in a wider precision than the storage: float32 for 16-bit storage (the table entries), float64
for float32; float64 storage runs in float64 with error-free products (Dekker), compensated
``x/sqrt 2``, ``x**2`` and tanh argument in the tail, and the exact Taylor expansion of GELU about
``x*`` next to the minimum.

Cost (measured in ``docs/gelu_bound.md``, "Speed"): 16-bit storage is a table gather each way
(rather than rebuilding every element); float32 storage is about 40 elementwise passes over
64k-element slices. The float32
forward stays in float64: float32 ``erfc`` would misround about 40% of the outputs. The saved
bit of a NaN input is never used (its gradient is NaN on either branch).

The forward differs from ``torch.nn.functional.gelu`` on purpose: torch evaluates
``0.5*x*(1+erf(x/sqrt 2))`` (or ``1+tanh``), which cancels for ``x < -3`` (float32 at ``x=-5``:
-1.19e-6 against the true -1.433e-6; ``-0.0`` from ``x=-6``). Here ``Phi(x) = erfc(-x/sqrt 2)/2``
and the tanh form is ``x*sigmoid(2z)``, both free of cancellation and computed one precision
wider than the storage, so leanact's output is the truth rounded once (16-bit: but for a few in
10^4 values, one ulp off; float64: within ~2 ulps) and differs from torch's only where torch's has
that cancellation error (and is then the closer to the float64 truth). Output is contiguous (torch
keeps a transposed input's strides); values are the same. Special values
follow torch's float64 kernel: ``GELU(+inf) = inf`` (torch's float32/bf16 erf kernel returns nan
there), ``GELU(-inf) = nan``, ``GELU(nan) = nan``, signed zeros kept; the gradient at ``+-inf``
and ``nan`` is nan and at ``+-0`` 0.5, as torch's.

Files: :mod:`.minimum` (x*, y*, the Taylor expansion about them, the forward's branch thresholds),
:mod:`.rebuild64` (the exact rebuild: float64 storage, and the builder of the 16-bit tables),
:mod:`.tables` (the table cache; 16-bit storage by lookup), :mod:`.rebuild32` (float32 storage:
table guess + one float64 step), :mod:`.slope32` and :mod:`.erfcx32` (the CUDA float32 kernels'
tables: the derivative per cell of the backward's key, the erf forward's ``erfcx``), :mod:`.buffers`
(eager slices, bit packing, workspaces), :mod:`.function` (the autograd Function, :func:`gelu`,
the registration of the kernels' self-check and the op's fake-tensor rule); on CUDA
:mod:`.launchers` (kernel or PyTorch path) with the Triton kernels of :mod:`.kernels16` (16-bit
storage) and :mod:`.kernels32` (float32 storage).
"""
from .function import GeluFunction, gelu, gelu_grad_from_output
from .minimum import gelu_minimum

__all__ = ["gelu", "GeluFunction", "gelu_minimum", "gelu_grad_from_output"]
