"""Exact fused linear + cross-entropy: the loss of ``x Wᵀ + b`` without materialising the logits.

    loss = F.cross_entropy(F.linear(x, W, b).float() [· scale] [→ c·tanh(·/c)], target,
                           ignore_index=, reduction=, label_smoothing=)

computed over chunks of rows (tokens) × the whole vocabulary. Neither the full logits nor their
fp32 copy, nor the log-softmax, is ever built.

Per valid token i (target ≠ ignore_index), with z the (scaled, soft-capped) logits in the
accumulation dtype (fp32 for 16-bit inputs, fp64 for fp64), lse_i = logsumexp_v z_iv and ε the
label smoothing (torch's definition, ``(1-ε)·nll + ε·mean_v(−log p)``):

    loss_i = lse_i − (1−ε)·z_{i,y_i} − (ε/V)·Σ_v z_iv
    ∂loss_i/∂z_iv = softmax(z_i)_v − (1−ε)·[v = y_i] − ε/V

``mean`` divides the sum by the number of valid tokens (NaN when there is none, as torch),
``sum`` sums, ``none`` returns per-token losses (0 at ignored tokens); ``num_items_in_batch``
(Hugging Face's gradient-accumulation path) divides the sum by that count instead. A chunk's
logits are the matmul in the compute dtype (the input's, or autocast's), upcast -- the values
``F.linear(...).float()`` gives (but see ``matmul_dtype`` below) -- and everything after (scale,
softcap, softmax, the loss and its sum) is in the accumulation dtype. Soft-capping:
∂z/∂raw = scale·(1 − (z/c)²).

The chunk plan (:func:`chunk_rows`, the same on every device): each chunk's transient is at most
5% of the fp32 logits plain PyTorch builds, with at least 128 rows (matmuls large enough to run at
full speed) and at most 2^25 logits: 261 rows at V = 128256. Per chunk: the logits matmul, torch's
row-wise softmax in place (the log-sum-exp read off it as m − log p(argmax), no underflow), the
one-hot and smoothing terms, the row factor folded into the rounding to the matmul dtype (16-bit)
or into the rows of dx and x (fp32), and the dx and dW matmuls: about 20 dispatched ops.

Two ways to get the gradients (``grad_in_forward``):

* ``False`` (default): forward keeps, per token, its fp32 log-sum-exp and its target as int32
  (**8 bytes per token**, plus x, which the op before usually keeps anyway -- one storage -- and
  the weight and bias, parameters); backward recomputes each chunk's logits and produces dx, dW,
  db. Four matmuls of the head's size instead of plain PyTorch's three.
* ``True`` (``reduction`` mean/sum only; ``none`` falls back to the default; what
  ``leanact.patch`` runs in training): forward computes the gradients chunk by chunk and keeps dx
  (x's size, x's dtype), dW (W's size and dtype) and db; backward only scales them by the incoming
  gradient. Three matmuls, as plain PyTorch; the gradients exist from the forward's end instead of
  the backward's start.

Matmuls run in the compute dtype, except for 16-bit inputs on a CPU without native 16-bit GEMM (no
AVX512-BF16 / AMX), where they run in fp32 on upcast chunks (``matmul_dtype``): bf16 GEMM there is
many times slower than fp32 (:mod:`leanact.ops.cpu_gemm`), and the fp32 products are
exact. Accumulation: dW over chunks in an fp32 buffer (W's size: ``addmm`` with ``out_dtype`` where
the device has it, CUDA), db in fp32; each is cast to its parameter's dtype once. The chunks' logit
gradients stay in one buffer (the matmul dtype) for :func:`product_rows` rows, whose dx, dW and db
are then one matmul each: on a GPU each sum into dW's accumulator costs a read and a write of V·H·4
bytes, so one per several chunks, not per chunk. Transients: that buffer (one chunk, or up to half
of dW's accumulator when dW sums over chunks), one chunk's fp32 logits on the PyTorch path, one
product's copy of x when its dtype differs from the matmul dtype, dx and the fp32 dW accumulator.

Ignored tokens: when fewer than half the tokens are valid (masked LM), the valid rows are gathered
first (real tensors; one host sync to count them) and ignored tokens cost nothing; otherwise (causal
LM: only the last positions) every row is computed and masked, without copying x. On fake tensors
(``leanact.estimate``) rows are always masked; the tensors kept for backward are the same.
Invalid targets raise IndexError as torch does (real tensors only). Double backward
(``create_graph=True``): by default the backward then computes the unfused computation's gradients
from the saved x, W and b as torch ops with their graph (exact, the logits built whole);
``grad_in_forward`` kept no inputs, so its gradients come back with their values and raise, naming
the ways out, when differentiated. Under ``torch.func`` transforms the composite
(``F.linear`` + ``F.cross_entropy``) runs instead.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from .. import fake_rules
from ..amp import autocast_dtype, autocast_off, no_autocast_backward
from ..embedding.tied_grad import hand_off
from ..backward import _raising
from ..cpu_gemm import native_16bit_gemm as _native_16bit_gemm
from ..transforms import functorch_active
from . import launchers as _launchers

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy", "linear_cross_entropy_reference", "chunk_rows",
           "product_rows", "DEFAULT_TILE_ELEMENTS", "MIN_CHUNK_ROWS", "TRANSIENT_FRACTION", "PRODUCT_FRACTION",
           "KEPT_BYTES_PER_TOKEN"]

DEFAULT_TILE_ELEMENTS = 1 << 25  # logits per chunk at most (rows x whole vocabulary: 261 rows at V = 128256)
MIN_CHUNK_ROWS = 128  # rows per chunk at least (matmuls large enough to run at full speed)
TRANSIENT_FRACTION = 0.05  # a chunk's transient at most this fraction of plain PyTorch's fp32 logits
KEPT_BYTES_PER_TOKEN = 8  # fp32 log-sum-exp + int32 target
#: gather the valid rows (a copy of them) when fewer than this fraction of the tokens are valid (a
#: masked-LM batch); otherwise compute every row and mask (a causal-LM batch ignores only its last
#: positions: no copy of x). Tests set 1.0 / 0.0 to force either path.
COMPACT = 0.5
#: the buffer of logit gradients one dW product sums is at most this fraction of dW's fp32 accumulator
#: (:func:`product_rows`; at least one chunk)
PRODUCT_FRACTION = 0.5
_REDUCTIONS = ("mean", "sum", "none")


def _matmul_dtype(cdtype: torch.dtype, device: torch.device) -> torch.dtype:
    """fp32 for 16-bit tiles on a CPU without native 16-bit GEMM (many times slower than fp32 there:
    :mod:`.cpu_gemm`)."""
    if device.type == "cpu" and cdtype in (torch.bfloat16, torch.float16) and not _native_16bit_gemm(cdtype):
        return torch.float32
    return cdtype


def _acc_dtype(cdtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(cdtype, torch.float32)


def chunk_rows(n: int, v: int, cdtype: torch.dtype, chunk_tokens: int | None = None,
               tile_elements: int | None = None, weight_dtype: torch.dtype | None = None, hidden: int = 0) -> int:
    """Rows per chunk; every chunk spans the whole vocabulary (one plan on every device).

    Default: the chunk's transient (its logits in the accumulation dtype, plus their 16-bit
    matmul output / gradient copy for 16-bit inputs) is at most :data:`TRANSIENT_FRACTION` of the
    fp32 logits plain PyTorch would build (N·V·4 bytes), at least :data:`MIN_CHUNK_ROWS` rows (so
    the matmuls stay large enough to run at full speed), and never more than
    :data:`DEFAULT_TILE_ELEMENTS` logits. With a 16-bit ``weight_dtype``, several chunks sum dW in
    an fp32 buffer of W's size (V·``hidden``·4 bytes): one chunk instead where all the logits'
    transient is no larger and fits that bound. ``chunk_tokens`` / ``tile_elements``, when given,
    bound the rows / the logits per chunk instead."""
    if chunk_tokens is not None or tile_elements is not None:
        rows = min(chunk_tokens or n, (tile_elements or DEFAULT_TILE_ELEMENTS) // max(v, 1))
        return max(1, min(n, rows))
    acc = _acc_dtype(cdtype)
    per_logit = acc.itemsize + (cdtype.itemsize if cdtype != acc else 0)
    if (weight_dtype is not None and weight_dtype.itemsize < 4 and n * per_logit <= 4 * hidden
            and n * v <= DEFAULT_TILE_ELEMENTS):
        return max(1, n)
    rows = int(TRANSIENT_FRACTION * 4 * n) // per_logit
    rows = min(max(rows, MIN_CHUNK_ROWS), DEFAULT_TILE_ELEMENTS // max(v, 1))
    return max(1, min(n, rows))


def product_rows(n: int, v: int, h: int, step: int, cdtype: torch.dtype) -> int:
    """Rows whose logit gradients one dW product sums, a whole number of chunks of ``step`` rows,
    where dW sums over several chunks: as many chunks as fit, in the matmul dtype, in
    :data:`PRODUCT_FRACTION` of dW's accumulator (V·H in the accumulation dtype), so dW's
    accumulator is read and written once per product, not once per chunk. On a GPU that read and
    write (2 GiB at V = 128,256, H = 2048) is memory-bound and costs more than a chunk's matmul: 32
    chunks of 261 rows per 8,192 tokens became 5 products of 1,827."""
    k = int(PRODUCT_FRACTION * v * h * _acc_dtype(cdtype).itemsize) // max(step * v * cdtype.itemsize, 1)
    return max(1, min(n, max(k, 1) * step))


def _starts(n: int, step: int):
    """Where the chunks start (every chunk's buffers are freed when the next one is made, so
    ``leanact.estimate`` runs only the first two and the last on fake tensors)."""
    return range(0, n, step)


def _rows(t, step: int):
    """``t.split(step)`` (one dispatch for every piece), None for ``t`` None. On fake tensors
    (``leanact.estimate``) the pieces are made when indexed instead, :class:`_LazyRows`."""
    return None if t is None else t.split(step)


class _LazyRows:
    """``t.split(step)`` made lazily: piece ``i`` is the view of rows ``i·step`` on, made when indexed.
    A million tokens are a thousand pieces, every fake view made costs, and the loops on fake tensors
    touch few of them (:func:`_starts`)."""

    __slots__ = ("t", "step")

    def __init__(self, t, step):
        self.t, self.step = t, step

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.t[i * self.step:(i + 1) * self.step]


def _matmul(xc, wt, bt, out=None):
    """A chunk's raw logits in the matmul dtype (into ``out`` when given); ``wt``: the weight
    transposed (H, V), ``bt`` the bias."""
    if out is None:
        return xc @ wt if bt is None else torch.addmm(bt, xc, wt)
    return torch.mm(xc, wt, out=out) if bt is None else torch.addmm(bt, xc, wt, out=out)


def _logits(z, acc, scale, softcap):
    """(z, t): raw logits ``z`` in ``acc``, scaled and soft-capped, and tanh(·) when soft-capped."""
    if z.dtype != acc:
        z = z.to(acc)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return z, None
    t = torch.tanh(z.div_(softcap))
    return torch.mul(t, softcap, out=z), t  # (z keeps its storage: a chunk's slot in the gradient buffer)


def _softmax_(z):
    """softmax(z) over the vocabulary, in place: torch's row-wise kernel (each row read twice and
    written once; on a CPU about 3x faster than max / sub / exp / sum passes over the chunk)."""
    return torch._softmax(z, 1, False, out=z)


_FP32_ADDMM: dict[str, bool] = {}  # device type -> addmm with out_dtype accumulates in place correctly


def _fp32_addmm_works(out, a) -> bool:
    """Whether ``torch.addmm(out, a, b, out_dtype=fp32, out=out)`` exists on this device type and adds
    in place correctly, probed once on small tensors (a device whose kernel lacks it, or handles the
    aliasing wrongly, takes the fallback: never a silently wrong dW)."""
    dev = out.device.type
    if dev not in _FP32_ADDMM:
        if is_fake(out):
            return True  # leanact.estimate: the allocation of the CUDA path (none)
        try:
            g = torch.Generator(device=out.device).manual_seed(0)
            c = torch.randn(8, 16, generator=g, device=out.device, dtype=out.dtype)
            x = torch.randn(8, 32, generator=g, device=out.device).to(a.dtype)
            y = torch.randn(32, 16, generator=g, device=out.device).to(a.dtype)
            want = c + x.to(out.dtype) @ y.to(out.dtype)
            torch.addmm(c, x, y, out_dtype=out.dtype, out=c)
            _FP32_ADDMM[dev] = bool(torch.allclose(c, want, rtol=1e-5, atol=1e-5))
        except (RuntimeError, NotImplementedError, TypeError):
            _FP32_ADDMM[dev] = False
    return _FP32_ADDMM[dev]


def _accumulate_mm_(out, a, b, step=None):
    """out += a @ b, ``out`` fp32 and a, b 16-bit: the products summed in fp32 (``addmm``'s
    ``out_dtype`` where the device has it, CUDA; else fp32 products of the upcast operands, ``step``
    of a's columns and b's rows at a time: a is a product's gradient (transposed), b its rows of x,
    and an upcast copy of one chunk's is far smaller than a whole product's)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif _fp32_addmm_works(out, a):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        _upcast_accumulate_mm_(out, a, b, step)


def _upcast_accumulate_mm_(out, a, b, step=None):
    """out += a @ b as fp32 products of upcast copies of ``step`` of a's columns and b's rows at a time."""
    step = step or b.shape[0]
    for k0 in range(0, b.shape[0], step):
        out.addmm_(a[:, k0:k0 + step].to(out.dtype), b[k0:k0 + step].to(out.dtype))


def _active(x, target, ignore_index, v):
    """(valid mask, rows or None, x rows, targets, n_valid tensor). Rows: indices of the valid tokens
    when some are ignored (real tensors); None = all rows, masked (fake tensors, none ignored, or a
    CUDA graph being captured, where the host cannot read the targets: the bound is then asserted on
    the device, as torch's own CUDA loss does)."""
    valid = target != ignore_index
    n_valid = valid.sum()
    rows = None
    if not (is_fake(x) or is_fake(target)) and _capturing(target):
        torch._assert_async(~(valid & ((target < 0) | (target >= v))).any(), "Target out of bounds.")
    elif not (is_fake(x) or is_fake(target)):
        bad = valid & ((target < 0) | (target >= v))
        if bool(bad.any()):
            raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")
        if int(n_valid) < COMPACT * target.numel():
            rows = valid.nonzero().squeeze(1)
    if rows is None:
        return valid, None, x, target.clamp(0, max(v - 1, 0)), n_valid
    return valid, rows, x.index_select(0, rows), target.index_select(0, rows), n_valid


def _capturing(t) -> bool:
    """Whether ``t``'s CUDA stream is capturing a graph (``torch.compile(mode="reduce-overhead")``)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _Chunks:
    """What forward and backward share: the valid rows, their upcast copy, the weight in the
    matmul dtype (transposed), the bias, the chunk plan."""

    def __init__(self, x, weight, bias, target, ignore_index, cdtype, chunk_tokens, tile_elements):
        self.n, self.h = x.shape
        self.v = weight.shape[0]
        self.acc = _acc_dtype(cdtype)
        self.valid, self.rows, xa, ya, self.n_valid = _active(x, target, ignore_index, self.v)
        self.na, self.cdtype, self.device = xa.shape[0], cdtype, x.device
        self.xa = xa
        self.wc = weight.to(cdtype)  # (a copy under autocast, as F.linear's)
        self.wt = self.wc.t()
        self.bc = None if bias is None else bias.to(cdtype)
        self.y = ya.unsqueeze(1)
        self.step = chunk_rows(self.na, self.v, cdtype, chunk_tokens, tile_elements, weight.dtype, self.h)
        self.one = self.step >= self.na

    def coef(self, per_row):
        """Per-row gradient factor: ``per_row`` (scalar or (na,)) times the valid mask (masked rows)."""
        c = per_row.expand(self.na) if per_row.dim() == 0 else per_row
        return c if self.rows is not None else c * self.valid.to(self.acc)

    def scatter(self, values, n_cols=None):
        """(na, ...) rows back to (n, ...) (zeros at the ignored rows when they were dropped)."""
        if self.rows is None:
            return values
        return values.new_zeros((self.n, *values.shape[1:])).index_copy_(0, self.rows, values)

    def grads(self, coef, eps, scale, softcap, needs, dx_dtype, dw_dtype, db_dtype, lse=None):
        """dx, dW, db of ``Σ coef_i·loss_i``, chunk by chunk; with ``lse`` None the forward's statistics
        are computed on the way and returned too: (dx, dw, db, lse, zy, zsum).

        Per chunk, in place on its logits z: p = softmax(z) (torch's row-wise kernel); the forward
        reads the log-sum-exp off it as m − log p(argmax); the target's entry gets −(1−ε) and every
        entry −ε/V; the row factor r = coef (× the logit scale) scales p while it is rounded to the
        matmul dtype (16-bit: one pass, the values the unfused backward rounds) or scales the rows of
        dx and of x after / before the matmuls (fp32: no pass over the chunk). The chunks' logit
        gradients stay in one buffer for :func:`product_rows` rows, whose dx, dW and db are then one
        matmul each: dW's fp32 accumulator is read and written once per product, not per chunk."""
        acc, na, v, h, dev, step = self.acc, self.na, self.v, self.h, self.device, self.step
        low = self.cdtype != acc  # 16-bit matmuls
        stats = lse is None
        zy = zsum = None
        if stats:
            lse = torch.empty(na, dtype=acc, device=dev)
            zy = torch.empty((na, 1), dtype=acc, device=dev)
            zsum = torch.empty(na, dtype=acc, device=dev) if eps else None
        dx = torch.empty((na, h), dtype=self.cdtype, device=dev) if needs[0] else None
        dw = None
        if needs[1]:
            dw = (torch.empty((v, h), dtype=self.cdtype, device=dev) if self.one
                  else torch.zeros((v, h), dtype=acc, device=dev))
        db = torch.zeros(v, dtype=acc, device=dev) if self.bc is not None and needs[2] else None
        group = step if dw is None or self.one else product_rows(na, v, h, step, self.cdtype)
        buf = torch.empty((min(group, na), v), dtype=self.cdtype, device=dev) if na else None
        neg = torch.full((min(step, na), 1), -(1.0 - eps), dtype=acc, device=dev)
        ys, cs, lses, zys, zsums = (_rows(t, step) for t in (self.y, coef, lse, zy, zsum))
        xgs, cgs, dxgs = (_rows(t, group) for t in (self.xa, coef, dx))
        xg = xc = zc = zg = xcs = zcs = None
        for g0 in _starts(na, group):
            gi, rows = g0 // group, min(group, na - g0)
            xg = xc = zc = zg = xcs = zcs = None  # (one product's copy of x alive at a time)
            xg = xgs[gi].to(self.cdtype)  # (a copy of one product's rows only, when the dtypes differ)
            zg = buf if rows == buf.shape[0] else buf[:rows]
            xcs, zcs = ((xg,), (zg,)) if rows <= step else (_rows(xg, step), _rows(zg, step))
            raw, starts = [], _starts(rows, step)
            for c0 in starts:
                i, j = (g0 + c0) // step, c0 // step
                z = t = e = None  # (one chunk's fp32 logits alive at a time)
                xc, zc, yc, cc = xcs[j], zcs[j], ys[i], cs[i]
                _matmul(xc, self.wt, self.bc, zc)
                if _launchers.chunk_(zc, yc, cc, lses[i], zys[i] if stats else lses[i],
                                     zsums[i] if zsums is not None else None, scale, softcap, eps, stats, True):
                    continue  # zc: the gradient, row factor applied
                z, t = _logits(zc, acc, scale, softcap)
                if stats:
                    torch.gather(z, 1, yc, out=zys[i])
                    if eps:
                        torch.sum(z, 1, out=zsums[i])
                    m, at = z.max(1, keepdim=True)
                e = _softmax_(z)
                if stats:  # lse = m - log p(argmax): p there is 1/Σexp(z - m), rounded once (no underflow)
                    torch.sub(m, e.gather(1, at).log_(), out=lses[i][:, None])
                e.scatter_add_(1, yc, neg[: e.shape[0]])
                if eps:
                    e.sub_(eps / v)
                if softcap is not None:
                    e.mul_(t.mul_(t).neg_().add_(1.0))
                if low:  # the row factor applied while rounding to the matmul dtype: the gradient itself
                    torch.mul(e, cc[:, None] * scale if scale != 1.0 else cc[:, None], out=zc)
                else:  # fp32: e is zc; the row factor goes on the rows of dx and x (no pass over the chunk)
                    raw.append(j)
            z = t = e = None
            r = None
            if raw:  # fp32 chunks of the PyTorch path: their row factor is still to apply
                r = cgs[gi][:, None] * scale if scale != 1.0 else cgs[gi][:, None]
                if len(raw) < len(starts):  # (some chunks ran the kernel: scale the others)
                    rs = _rows(r, step)
                    for j in raw:
                        zcs[j].mul_(rs[j])
                    r = None
            self._matmuls(zg, xg, None if dx is None else dxgs[gi], dw, db, acc, r)
        # the gradients go before the results are cast (views of buf too)
        buf = xg = xc = zc = zg = xcs = zcs = dxgs = None
        if na == 0 and dw is not None:
            dw.zero_()
        dx = None if dx is None else self.scatter(dx).to(dx_dtype)
        dw = None if dw is None else dw.to(dw_dtype)
        db = None if db is None else db.to(db_dtype)
        return (dx, dw, db, lse, zy, zsum) if stats else (dx, dw, db)

    def _matmuls(self, g, xg, dx, dw, db, acc, r):
        """dx rows, dW and db of a product's rows from their logit gradient ``g`` (``r``: row factors
        still to apply, None when g has them)."""
        if dx is not None:
            torch.mm(g, self.wc, out=dx)
            if r is not None:
                dx.mul_(r)
        if dw is not None:
            xr = xg if r is None else xg * r
            if self.one:
                torch.mm(g.t(), xr, out=dw)
            else:
                _accumulate_mm_(dw, g.t(), xr, self.step)
        if db is not None:
            if r is None:
                db += g.sum(0, dtype=acc)
            else:
                db.addmv_(g.t(), r.squeeze(1))

    def stats(self, eps, scale, softcap):
        """Forward without gradients: (lse, zy, zsum) chunk by chunk."""
        acc, na, dev, step = self.acc, self.na, self.device, self.step
        lse = torch.empty(na, dtype=acc, device=dev)
        zy = torch.empty((na, 1), dtype=acc, device=dev)
        zsum = torch.empty(na, dtype=acc, device=dev) if eps else None
        xs, ys, lses, zys, zsums = (_rows(t, step) for t in (self.xa, self.y, lse, zy, zsum))
        for r0 in _starts(na, step):
            i = r0 // step
            z = t = None
            z = _matmul(xs[i].to(self.cdtype), self.wt, self.bc)
            if _launchers.chunk_(z, ys[i], None, lses[i], zys[i], zsums[i] if zsums is not None else None, scale,
                                 softcap, eps, True, False):
                continue
            z, t = _logits(z, acc, scale, softcap)
            torch.gather(z, 1, ys[i], out=zys[i])
            if eps:
                torch.sum(z, 1, out=zsums[i])
            torch.logsumexp(z, 1, out=lses[i])
        return lse, zy, zsum


def _forward(x, weight, bias, target, ignore_index, reduction, eps, scale, softcap, cdtype, chunk_tokens,
             tile_elements, grads_of):
    """The loss, and with ``grads_of`` (which of x, W, b; reduction mean or sum) their gradients
    computed chunk by chunk (grad_in_forward): (chunks, loss, (dx, dW, db), per-token lse)."""
    ch = _Chunks(x, weight, bias, target, ignore_index, cdtype, chunk_tokens, tile_elements)
    acc, v = ch.acc, ch.v
    grads = (None, None, None)
    if grads_of is not None:
        per_row = (torch.ones((), dtype=acc, device=x.device) if reduction == "sum"
                   else 1.0 / ch.n_valid.clamp(min=1).to(acc))  # (no valid row: unused)
        *grads, lse, zy, zsum = ch.grads(ch.coef(per_row), eps, scale, softcap, grads_of, x.dtype,
                                         weight.dtype, None if bias is None else bias.dtype)
    else:
        lse, zy, zsum = ch.stats(eps, scale, softcap)
    per = lse - zy.squeeze(1) * (1.0 - eps)
    if eps:
        per = per - zsum * (eps / v)
    if ch.rows is None:
        per = per * ch.valid.to(acc)
    if reduction == "none":
        out = ch.scatter(per)
    else:
        out = per.sum()
        if reduction == "mean":
            out = out / ch.n_valid.to(acc)
    return ch, out, tuple(grads), lse


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Fused linear + cross-entropy over chunks of rows × the whole vocabulary (module docstring).
    x: (N, H), weight: (V, H), bias: (V,) or None, target: (N,) integer. Returns the fp32 (fp64 for
    fp64) loss."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, eps, scale, softcap, cdtype,
                chunk_tokens, tile_elements, grad_in_forward, anchors):
        needs = ctx.needs_input_grad
        eager = bool(grad_in_forward) and reduction != "none" and any(needs[:3])
        ch, out, grads, lse = _forward(x, weight, bias, target, ignore_index, reduction, eps, scale, softcap, cdtype,
                                       chunk_tokens, tile_elements, needs[:3] if eager else None)
        dx, dw, db = grads
        ctx.reduction, ctx.eps, ctx.scale, ctx.softcap, ctx.cdtype = reduction, eps, scale, softcap, cdtype
        ctx.chunk_tokens, ctx.tile_elements, ctx.eager = chunk_tokens, tile_elements, eager
        ctx.anchors = anchors if eager else ()
        if eager:
            for t in (dx, dw, db):  # gradients, not activations: the meter files them apart, and
                if t is not None:  # lossy compression leaves them exact
                    t._leanact_gradient = t._leanact_exact = True
            ctx.save_for_backward(dx, dw, db)  # scaled in backward by the incoming gradient
        else:
            t32 = torch.where(ch.valid, target, -1).to(torch.int32 if ch.v < 2**31 else torch.int64)
            ctx.save_for_backward(x, weight, bias, ch.scatter(lse), t32)
        return out

    @staticmethod
    @no_autocast_backward
    def backward(ctx, g):
        if torch.is_grad_enabled():  # create_graph=True
            return _backward_with_graph(ctx, g)
        dx, dw, *rest = _backward(ctx, g)
        return dx, hand_off(ctx, 1, dw), *rest  # (a tied embedding may take dW: leanact.ops.embedding)


_NONES = (None,) * 11  # the gradients of target, the options and the anchors


def _backward(ctx, g):
    """dx, dW, db: grad_in_forward's kept gradients scaled by ``g``, or recomputed chunk by chunk."""
    if ctx.eager:
        return (*(None if t is None else (t * g).to(t.dtype) for t in ctx.saved_tensors), *_NONES)
    x, weight, bias, lse_full, t32 = ctx.saved_tensors
    ch = _Chunks(x, weight, bias, t32.long(), -1, ctx.cdtype, ctx.chunk_tokens, ctx.tile_elements)
    acc = ch.acc
    lse = lse_full if ch.rows is None else lse_full.index_select(0, ch.rows)
    g = g.to(acc)
    if ctx.reduction == "none":
        coef = ch.coef(g.reshape(-1) if ch.rows is None else g.reshape(-1).index_select(0, ch.rows))
    else:
        coef = ch.coef(g if ctx.reduction == "sum" else g / ch.n_valid.clamp(min=1).to(acc))
    dx, dw, db = ch.grads(coef, ctx.eps, ctx.scale, ctx.softcap, ctx.needs_input_grad[:3], x.dtype,
                          weight.dtype, None if bias is None else bias.dtype, lse=lse)
    return dx, dw, db, *_NONES


_TWICE = ("trying to differentiate twice {name} with grad_in_forward=True (what leanact.patch's language-model "
          "head runs): its gradients were computed in the forward, without a graph (create_graph=True: a "
          "gradient penalty, a Hessian-vector product). Pass grad_in_forward=False (differentiable twice), or "
          "compute the patched model's loss unfused: leanact.patch(model, fused_loss=False), "
          "`with leanact.keep_logits():` around the forward, or leanact.unpatch(model)")


def _backward_with_graph(ctx, g):
    """backward under ``create_graph=True``. Default mode: the unfused computation's gradients of the
    saved x, W, b, as torch ops with their graph (a double backward through them is exact; the logits
    are built whole, as unfused). grad_in_forward kept no inputs: its gradients come back with their
    values, raising when differentiated, from a node on the paths to x, W and b (:func:`_anchors`)."""
    if ctx.eager:
        with torch.no_grad():
            grads = _backward(ctx, g)
        return _raising(grads, "leanact's fused linear + cross-entropy", _TWICE, ctx.anchors)
    x, weight, bias, _, t32 = ctx.saved_tensors
    c = ctx.cdtype
    loss = linear_cross_entropy_reference(x.to(c), weight.to(c), t32.long(), None if bias is None else bias.to(c),
                                          ignore_index=-1, reduction=ctx.reduction, label_smoothing=ctx.eps,
                                          scale=ctx.scale, softcap=ctx.softcap)
    needs = ctx.needs_input_grad[:3]
    grads = iter(torch.autograd.grad(loss, [t for t, n in zip((x, weight, bias), needs) if n], g, create_graph=True))
    return (*(next(grads) if n else None for n in needs), *_NONES)


def _anchors(*ts) -> tuple:
    """Per tensor requiring grad, a tiny one on its graph: a leaf itself (a parameter, alive anyway), else
    a one-element copy (not its storage). grad_in_forward keeps none of its inputs, yet differentiating
    its create_graph gradients must reach a node that raises on every path to them
    (:func:`leanact.ops.backward._raising`). Two selects and a copy of x's first element per call."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(t if t.is_leaf else t[(0,) * t.dim()].clone() for t in ts
                 if t is not None and t.requires_grad and t.numel())


def linear_cross_entropy_reference(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                   label_smoothing=0.0, scale=1.0, softcap=None, num_items_in_batch=None):
    """The unfused computation the fused op equals: full logits, upcast, ``F.cross_entropy``."""
    z = F.linear(input, weight, bias)
    z = z.to(_acc_dtype(z.dtype))
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z.reshape(-1, z.shape[-1])
    red = "sum" if num_items_in_batch is not None else reduction
    loss = F.cross_entropy(z, target.reshape(-1), ignore_index=ignore_index, reduction=red,
                           label_smoothing=label_smoothing)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    elif reduction == "none":
        loss = loss.reshape(target.shape)
    return loss


def linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    scale: float = 1.0,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    grad_in_forward: bool = False,
    matmul_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
    tile_elements: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias).float(), target, ...)`` without the logits.

    input: (..., H); weight: (V, H); bias: (V,) or None; target: input's leading shape, class
    indices. ``scale`` multiplies the logits, then ``softcap`` c gives c·tanh(z/c) (Gemma 2/3).
    ``num_items_in_batch``: Hugging Face's gradient-accumulation divisor (the loss is then
    sum / num_items_in_batch, whatever ``reduction``). The result is fp32 (fp64 for fp64 inputs);
    ``reduction="none"`` returns target's shape. Under autocast the matmuls run in autocast's
    dtype, as ``F.linear`` would. ``matmul_dtype``: the dtype of the tiles' matmuls; None = the
    compute dtype, except 16-bit on a CPU without native 16-bit GEMM (no AVX512-BF16/AMX), where
    fp32 is faster (the 16-bit GEMM is emulated) and more accurate. See the module docstring for
    what is kept.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if (chunk_tokens is not None and chunk_tokens < 1) or (tile_elements is not None and tile_elements < 1):
        raise ValueError(f"chunk_tokens and tile_elements must be >= 1 (or None), got {chunk_tokens}, {tile_elements}")
    if weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise RuntimeError(f"linear_cross_entropy: input (..., {input.shape[-1]}) and weight "
                           f"{tuple(weight.shape)} do not match (weight must be (V, {input.shape[-1]}))")
    h = input.shape[-1]
    x = input.reshape(-1, h)
    tgt = target.reshape(-1)
    if x.shape[0] != tgt.shape[0]:
        raise ValueError(f"Expected input batch_size ({x.shape[0]}) to match target batch_size ({tgt.shape[0]}).")
    if tgt.dtype.is_floating_point or tgt.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy takes class indices as target, got {tgt.dtype}")
    if functorch_active():
        return linear_cross_entropy_reference(input, weight, target, bias, ignore_index=ignore_index,
                                              reduction=reduction, label_smoothing=label_smoothing, scale=scale,
                                              softcap=softcap, num_items_in_batch=num_items_in_batch)
    ac = autocast_dtype(x.device.type)
    if ac is not None:
        cdtype = ac
    elif x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise RuntimeError(f"linear_cross_entropy: expected input, weight and bias of one dtype, got {x.dtype}, "
                           f"{weight.dtype}, {None if bias is None else bias.dtype}")
    else:
        cdtype = x.dtype
    red = "sum" if num_items_in_batch is not None else reduction
    cdtype = _matmul_dtype(cdtype, x.device) if matmul_dtype is None else matmul_dtype
    anchors = _anchors(x, weight, bias) if grad_in_forward and red != "none" else ()
    with autocast_off(x.device.type):
        loss = LinearCrossEntropyFunction.apply(x, weight, bias, tgt, int(ignore_index), red, float(label_smoothing),
                                                float(scale), None if softcap is None else float(softcap), cdtype,
                                                chunk_tokens, tile_elements, bool(grad_in_forward), anchors)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch
    return loss.reshape(target.shape) if reduction == "none" else loss


# -- on fake tensors (leanact.estimate) ----------------------------------------------------------

_CPU_FP32_ADDMM: list[bool] = []  # whether this torch's CPU addmm takes out_dtype (probed once)


def _cpu_fp32_addmm() -> bool:
    if not _CPU_FP32_ADDMM:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            a = torch.ones(2, 2, dtype=torch.bfloat16)
            try:
                torch.addmm(torch.zeros(2, 2), a, a, out_dtype=torch.float32, out=torch.zeros(2, 2))
                _CPU_FP32_ADDMM.append(True)
            except (RuntimeError, NotImplementedError, TypeError):
                _CPU_FP32_ADDMM.append(False)
    return _CPU_FP32_ADDMM[0]


@contextlib.contextmanager
def _fake_rule(run):
    """On fake tensors: the token and vocabulary loops run their first two and last tiles (every
    full tile allocates alike, the last may be ragged: the same peak); and the matmuls are chosen
    as on the modelled device, not the fake tensors' CPU: the tiles' matmul dtype ("cuda": the
    compute dtype, whatever the host CPU; "cpu": this CPU's choice), and the fp32 accumulation of
    16-bit products (``addmm`` with ``out_dtype`` into the fp32 sum where the device has it -- CUDA;
    this CPU if it does -- else fp32 products of upcast copies, one chunk at a time). (The op
    remembers a failed ``out_dtype`` call per device type, which would make the estimate depend on
    what ran before it in the process.)"""
    starts, matmul, accumulate = _starts, _matmul_dtype, _accumulate_mm_

    def some_tiles(n: int, step: int):
        every = starts(n, step)
        return sorted({*every[:2], every[-1]}) if fake_rules.faking() and len(every) > 3 else every

    def matmul_dtype(cdtype, device):
        return cdtype if fake_rules.faking() and run.kind == "cuda" else matmul(cdtype, device)

    def accumulate_mm_(out, a, b, step=None):
        if not (fake_rules.faking() and is_fake(out)) or a.dtype == out.dtype:
            return accumulate(out, a, b, step)
        if run.kind == "cuda":
            return  # cuBLAS accumulates the 16-bit product into the fp32 sum itself: nothing allocated
            # (and fake addmm with out_dtype fails in some torch versions: 2.11 decomposes it as
            # addmm(self, mat1, mat2, beta, alpha), taking out_dtype for beta)
        if _cpu_fp32_addmm():
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            _upcast_accumulate_mm_(out, a, b, step)

    def lazy_rows(t, step):
        return None if t is None else _LazyRows(t, step) if fake_rules.faking() else t.split(step)

    with fake_rules.swapped(sys.modules[__name__], _starts=some_tiles if run.fewer_iterations else None,
                            _rows=lazy_rows if run.fewer_iterations else None,
                            _matmul_dtype=matmul_dtype, _accumulate_mm_=accumulate_mm_):
        yield


fake_rules.register("linear cross-entropy", rule=_fake_rule)
