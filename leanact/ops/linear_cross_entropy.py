"""Exact fused linear + cross-entropy: the loss of ``x Wᵀ + b`` without materialising the logits.

    loss = F.cross_entropy(F.linear(x, W, b).float() [· scale] [→ c·tanh(·/c)], target,
                           ignore_index=, reduction=, label_smoothing=)

computed over tiles of (tokens × vocabulary). Only one tile of logits exists at a time; neither the
full logits nor their fp32 copy, nor the log-softmax, is ever built.

Per valid token i (target ≠ ignore_index), with z the (scaled, soft-capped) logits in the
accumulation dtype (fp32 for 16-bit inputs, fp64 for fp64), lse_i = logsumexp_v z_iv and ε the
label smoothing (torch's definition, ``(1-ε)·nll + ε·mean_v(−log p)``):

    loss_i = lse_i − (1−ε)·z_{i,y_i} − (ε/V)·Σ_v z_iv
    ∂loss_i/∂z_iv = softmax(z_i)_v − (1−ε)·[v = y_i] − ε/V

``mean`` divides the sum by the number of valid tokens (NaN when there is none, as torch),
``sum`` sums, ``none`` returns per-token losses (0 at ignored tokens); ``num_items_in_batch``
(Hugging Face's gradient-accumulation path) divides the sum by that count instead. The logits of a
tile are the matmul in the compute dtype (the input's, or autocast's), upcast -- the values
``F.linear(...).float()`` gives (but see ``matmul_dtype`` below) -- and everything after (scale,
softcap, logsumexp, the loss and its sum) is in the accumulation dtype. Soft-capping:
∂z/∂raw = scale·(1 − (z/c)²).

Two ways to get the gradients (``grad_in_forward``):

* ``False`` (default): forward keeps, per token, its fp32 log-sum-exp and its target as int32
  (**8 bytes per token**, plus x, which the op before usually keeps anyway -- one storage -- and
  the weight and bias, parameters); backward recomputes each tile's logits and produces dx, dW, db
  directly. Four matmuls of the head's size instead of plain PyTorch's three.
* ``True`` (``reduction`` mean/sum only; ``none`` falls back to the default): forward computes the
  gradients chunk by chunk (a tile is a chunk of tokens × the whole vocabulary) and keeps dx
  (x's size, x's dtype), dW (W's size and dtype) and db; backward only scales them by the incoming
  gradient. Three matmuls, as plain PyTorch, but dx/dW-sized results are kept from forward to
  backward.

Matmuls run in the compute dtype, except for 16-bit inputs on a CPU without native 16-bit GEMM
(no AVX512-BF16 / AMX), where they run in fp32 on upcast tiles (``matmul_dtype``): oneDNN emulates
bf16 GEMM there about 4x slower than fp32, and the fp32 products are exact, so the loss and
gradients are then more accurate than the unfused 16-bit computation (whose logits are rounded to
16 bits). Accumulation: dx over vocabulary tiles in an fp32 buffer (the size of x), dW of a
vocabulary tile over token chunks in an fp32 buffer (tile × hidden), db in fp32; each is cast to
its parameter's dtype once. Transients are one tile: ``tile_elements`` logits (default 2^20; 2^25 with
``grad_in_forward``, whose tiles span the whole vocabulary and whose matmuls need enough rows to be
efficient) -- a few bytes per element for the logits, probabilities and their 16-bit copy -- plus
the fp32 dx buffer.

Ignored tokens: when fewer than half the tokens are valid (masked LM), the valid rows are gathered
first (real tensors; one host sync to count them) and ignored tokens cost nothing; otherwise (causal
LM: only the last positions) every row is computed and masked, without copying x. On fake tensors
(``leanact.estimate``) rows are always masked; the tensors kept for backward are the same.
Invalid targets raise IndexError as torch does (real tensors only). Double backward raises
(``once_differentiable``). Under ``torch.func`` transforms the composite
(``F.linear`` + ``F.cross_entropy``) runs instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from .amp import autocast_dtype, autocast_off, no_autocast_backward
from .transforms import functorch_active

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy", "linear_cross_entropy_reference",
           "DEFAULT_TILE_ELEMENTS", "DEFAULT_TILE_ELEMENTS_GRAD_IN_FORWARD", "DEFAULT_CHUNK_TOKENS",
           "KEPT_BYTES_PER_TOKEN"]

DEFAULT_TILE_ELEMENTS = 1 << 20  # logits per tile (4 MiB in fp32)
DEFAULT_TILE_ELEMENTS_GRAD_IN_FORWARD = 1 << 25  # rows x whole vocabulary (~260 tokens at V = 128256)
DEFAULT_CHUNK_TOKENS = 4096  # tokens per chunk at most (recompute mode)
KEPT_BYTES_PER_TOKEN = 8  # fp32 log-sum-exp + int32 target
#: gather the valid rows (a copy of them) when fewer than this fraction of the tokens are valid (a
#: masked-LM batch); otherwise compute every row and mask (a causal-LM batch ignores only its last
#: positions: no copy of x). Tests set 1.0 / 0.0 to force either path.
COMPACT = 0.5
_REDUCTIONS = ("mean", "sum", "none")


def _native_16bit_gemm(dtype: torch.dtype) -> bool:
    try:
        if dtype == torch.bfloat16:
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.cpu._is_amx_fp16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - other torch builds
        return True


def _matmul_dtype(cdtype: torch.dtype, device: torch.device) -> torch.dtype:
    """fp32 for 16-bit tiles on a CPU that emulates 16-bit GEMM (about 4x slower than fp32 there)."""
    if device.type == "cpu" and cdtype in (torch.bfloat16, torch.float16) and not _native_16bit_gemm(cdtype):
        return torch.float32
    return cdtype


def _acc_dtype(cdtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(cdtype, torch.float32)


def _tiles(n: int, v: int, chunk_tokens: int, tile_elements: int, full_vocab: bool, upcast_h: int = 0):
    """(rows per chunk, vocabulary per tile). ``upcast_h``: the hidden size when the weight's tiles are
    upcast for the matmuls: the tile's weight copy (tile × hidden) is then held to 4·``tile_elements``
    (with few tokens narrower tiles would be cheaper in memory, but fp32 GEMM on CPU loses half its
    throughput on 512-wide tiles)."""
    if full_vocab:
        return max(1, min(n, tile_elements // max(v, 1))), v
    rows = max(1, min(n, chunk_tokens))
    return rows, max(1, min(v, tile_elements // max(rows, upcast_h // 4)))


def _starts(n: int, step: int):
    """Where the tiles along a dimension of ``n`` start (every tile's buffers are freed when the next
    one is made, so ``leanact.estimate`` runs only the first two and the last on fake tensors)."""
    return range(0, n, step)


def _logits(xc, wt, bt, acc, scale, softcap):
    """(z, t): a tile's logits in ``acc`` (scaled, soft-capped) and tanh(·) when soft-capped; ``wt``,
    ``bt``: the tile's rows of the weight and bias, in the matmul dtype."""
    if bt is None:
        z = xc @ wt.t()
    else:
        z = torch.addmm(bt, xc, wt.t())
    z = z.to(acc)
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return z, None
    t = z.div_(softcap).tanh_()
    return t * softcap, t


def _dlogits(z, t, lse, coef, yl, sel, eps, v, scale, softcap):
    """∂loss/∂raw logits of a tile, in place of z: coef·(softmax − (1−ε)·onehot − ε/V), chained
    through the soft-cap and the scale. ``yl``: target index within the tile (clamped), ``sel``:
    whether the target falls in this tile."""
    dz = z.sub_(lse[:, None]).exp_().mul_(coef[:, None])
    if eps:
        dz.sub_((coef * (eps / v))[:, None])
    dz.scatter_add_(1, yl[:, None], (-(1.0 - eps) * coef * sel)[:, None])
    if softcap is not None:
        dz.mul_(t.mul_(t).neg_().add_(1.0))
    if scale != 1.0:
        dz.mul_(scale)
    return dz


def _active(x, target, ignore_index, v):
    """(valid mask, rows or None, x rows, targets, n_valid tensor). Rows: indices of the valid tokens
    when some are ignored (real tensors); None = all rows, masked (fake tensors, or none ignored)."""
    valid = target != ignore_index
    n_valid = valid.sum()
    rows = None
    if not (is_fake(x) or is_fake(target)):
        bad = valid & ((target < 0) | (target >= v))
        if bool(bad.any()):
            raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")
        if int(n_valid) < COMPACT * target.numel():
            rows = valid.nonzero().squeeze(1)
    if rows is None:
        return valid, None, x, target.clamp(0, max(v - 1, 0)), n_valid
    return valid, rows, x.index_select(0, rows), target.index_select(0, rows), n_valid


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Fused linear + cross-entropy over tiles (see the module docstring). x: (N, H), weight: (V, H),
    bias: (V,) or None, target: (N,) integer. Returns the fp32 (fp64 for fp64) loss."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, eps, scale, softcap, cdtype,
                chunk_tokens, tile_elements, grad_in_forward):
        n, h = x.shape
        v = weight.shape[0]
        acc = _acc_dtype(cdtype)
        valid, rows, xa, ya, n_valid = _active(x, target, ignore_index, v)
        na = xa.shape[0]
        needs = ctx.needs_input_grad
        eager = bool(grad_in_forward) and reduction != "none" and any(needs[:3])
        t_rows, t_vocab = _tiles(na, v, chunk_tokens, tile_elements, eager, h if weight.dtype != cdtype else 0)
        mask = None if rows is not None else valid.to(acc)
        lse = torch.full((na,), -torch.inf, dtype=acc, device=x.device)
        zy = torch.zeros(na, dtype=acc, device=x.device)
        zsum = torch.zeros(na, dtype=acc, device=x.device) if eps else None
        if eager:
            coef_all = (torch.ones((), dtype=acc, device=x.device) if reduction == "sum"
                        else 1.0 / n_valid.clamp(min=1).to(acc)).expand(na)  # (no valid row: unused)
            if mask is not None:
                coef_all = coef_all * mask
            one = t_rows >= na  # one chunk: dW straight in W's dtype, else summed over chunks in fp32
            wc = weight.to(cdtype)  # (a copy under autocast or with fp32 matmuls of 16-bit inputs)
            dx = torch.zeros((na, h), dtype=cdtype, device=x.device) if needs[0] else None
            dw_acc = torch.zeros((v, h), dtype=weight.dtype if one else acc, device=x.device) if needs[1] else None
            db = torch.zeros(v, dtype=acc, device=x.device) if bias is not None and needs[2] else None
        wt = bt = None
        x1 = xa.to(cdtype) if t_rows >= na else None  # one chunk: upcast once, not once per tile
        for v0 in _starts(v, t_vocab):
            v1 = min(v, v0 + t_vocab)
            wt = bt = None  # the previous tile's copies go before the next is made
            wt = wc if eager else weight[v0:v1].to(cdtype)
            bt = None if bias is None else bias[v0:v1].to(cdtype)
            for r0 in _starts(na, t_rows):
                r1 = min(na, r0 + t_rows)
                z = t = dz = dzl = xc = None  # (one tile alive at a time)
                xc = x1 if x1 is not None else xa[r0:r1].to(cdtype)  # (an upcast copy of one chunk)
                z, t = _logits(xc, wt, bt, acc, scale, softcap)
                y = ya[r0:r1] - v0
                sel = (y >= 0) & (y < v1 - v0)
                yl = y.clamp(0, v1 - v0 - 1)
                zy[r0:r1] += torch.where(sel, z.gather(1, yl[:, None]).squeeze(1), 0.0)
                if eps:
                    zsum[r0:r1] += z.sum(1)
                tl = torch.logsumexp(z, 1)
                lse[r0:r1] = tl if v0 == 0 else torch.logaddexp(lse[r0:r1], tl)
                if eager:  # one tile = the whole vocabulary: the gradient right away
                    dz = _dlogits(z, t, lse[r0:r1], coef_all[r0:r1], yl, sel.to(acc), eps, v, scale, softcap)
                    dzl = dz.to(cdtype)
                    if dx is not None:
                        torch.mm(dzl, wt, out=dx[r0:r1])
                    if dw_acc is not None and one and dw_acc.dtype == cdtype:
                        torch.mm(dzl.t(), xc, out=dw_acc)
                    elif dw_acc is not None and (one or acc != cdtype):
                        dw_acc += dzl.t() @ xc
                    elif dw_acc is not None:
                        dw_acc.addmm_(dzl.t(), xc)
                    if db is not None:
                        db.add_(dz.sum(0))
        per = lse - zy * (1.0 - eps)
        if eps:
            per = per - zsum * (eps / v)
        if mask is not None:
            per = per * mask
        if reduction == "none":
            out = per if rows is None else per.new_zeros(n).index_copy_(0, rows, per)
        else:
            out = per.sum()
            if reduction == "mean":
                out = out / n_valid.to(acc)
        ctx.reduction, ctx.eps, ctx.scale, ctx.softcap, ctx.cdtype = reduction, eps, scale, softcap, cdtype
        ctx.chunk_tokens, ctx.tile_elements, ctx.eager = chunk_tokens, tile_elements, eager
        ctx.has_bias = bias is not None
        if eager:
            if dx is not None:
                dx = (dx if rows is None else dx.new_zeros((n, h)).index_copy_(0, rows, dx)).to(x.dtype)
            dw = None if dw_acc is None else dw_acc.to(weight.dtype)
            db = None if db is None else db.to(bias.dtype)
            ctx.save_for_backward(dx, dw, db)  # gradients, scaled in backward by the incoming one
        else:
            lse_full = lse if rows is None else lse.new_zeros(n).index_copy_(0, rows, lse)
            t32 = torch.where(valid, target, -1).to(torch.int32 if v < 2**31 else torch.int64)
            ctx.save_for_backward(x, weight, bias, lse_full, t32)
        return out

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, g):
        if ctx.eager:
            return (*(None if t is None else (t * g).to(t.dtype) for t in ctx.saved_tensors),
                    None, None, None, None, None, None, None, None, None, None)
        x, weight, bias, lse_full, t32 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        cdtype, eps, scale, softcap = ctx.cdtype, ctx.eps, ctx.scale, ctx.softcap
        acc = _acc_dtype(cdtype)
        n, h = x.shape
        v = weight.shape[0]
        valid, rows, xa, ya, n_valid = _active(x, t32.long(), -1, v)
        na = xa.shape[0]
        lse = lse_full if rows is None else lse_full.index_select(0, rows)
        g = g.to(acc)
        if ctx.reduction == "none":
            coef = g.reshape(-1) if rows is None else g.reshape(-1).index_select(0, rows)
        else:
            coef = (g if ctx.reduction == "sum" else g / n_valid.clamp(min=1).to(acc)).expand(na)
        if rows is None:
            coef = coef * valid.to(acc)
        t_rows, t_vocab = _tiles(na, v, ctx.chunk_tokens, ctx.tile_elements, False, h if weight.dtype != cdtype else 0)
        dx_acc = torch.zeros((na, h), dtype=acc, device=x.device) if needs[0] else None
        dw = torch.empty_like(weight) if needs[1] else None
        db = torch.zeros(v, dtype=acc, device=x.device) if ctx.has_bias and needs[2] else None
        one_chunk = t_rows >= na
        x1 = xa.to(cdtype) if one_chunk else None  # one chunk: upcast once, not once per tile
        for v0 in _starts(v, t_vocab):
            v1 = min(v, v0 + t_vocab)
            wt = bt = dw_tile = None  # the previous tile's buffers go before the next is made
            wt = weight[v0:v1].to(cdtype)
            bt = None if bias is None else bias[v0:v1].to(cdtype)
            dw_tile = None if dw is None or one_chunk else torch.zeros((v1 - v0, h), dtype=acc, device=x.device)
            for r0 in _starts(na, t_rows):
                r1 = min(na, r0 + t_rows)
                z = t = dz = dzl = xc = None  # (one tile alive at a time)
                xc = x1 if x1 is not None else xa[r0:r1].to(cdtype)  # (an upcast copy of one chunk)
                z, t = _logits(xc, wt, bt, acc, scale, softcap)
                y = ya[r0:r1] - v0
                sel = ((y >= 0) & (y < v1 - v0)).to(acc)
                dz = _dlogits(z, t, lse[r0:r1], coef[r0:r1], y.clamp(0, v1 - v0 - 1), sel, eps, v, scale, softcap)
                dzl = dz.to(cdtype)
                if dx_acc is not None:
                    if acc == cdtype:
                        dx_acc[r0:r1].addmm_(dzl, wt)
                    else:
                        dx_acc[r0:r1] += dzl @ wt
                if dw is not None:
                    if one_chunk and dw.dtype == cdtype:
                        torch.mm(dzl.t(), xc, out=dw[v0:v1])
                    elif one_chunk:
                        dw[v0:v1] = dzl.t() @ xc
                    elif acc == cdtype:
                        dw_tile.addmm_(dzl.t(), xc)
                    else:
                        dw_tile += dzl.t() @ xc
                if db is not None:
                    db[v0:v1] += dz.sum(0)
            if dw_tile is not None:
                dw[v0:v1] = dw_tile
        z = t = dz = dzl = wt = bt = dw_tile = xa = xc = x1 = None  # the tiles go before dx is cast
        if dw is not None and na == 0:
            dw.zero_()
        dx = None
        if dx_acc is not None:
            dx = dx_acc.to(x.dtype) if rows is None else x.new_zeros((n, h)).index_copy_(0, rows, dx_acc.to(x.dtype))
        if db is not None:
            db = db.to(bias.dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
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
    if tile_elements is None:
        tile_elements = DEFAULT_TILE_ELEMENTS_GRAD_IN_FORWARD if grad_in_forward else DEFAULT_TILE_ELEMENTS
    if chunk_tokens < 1 or tile_elements < 1:
        raise ValueError(f"chunk_tokens and tile_elements must be >= 1, got {chunk_tokens}, {tile_elements}")
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
    with autocast_off(x.device.type):
        loss = LinearCrossEntropyFunction.apply(x, weight, bias, tgt, int(ignore_index), red, float(label_smoothing),
                                                float(scale), None if softcap is None else float(softcap), cdtype,
                                                int(chunk_tokens), int(tile_elements), bool(grad_in_forward))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch
    return loss.reshape(target.shape) if reduction == "none" else loss
