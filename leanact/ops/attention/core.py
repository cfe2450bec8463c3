"""Blocked kernels behind :func:`leanact.ops.attention.attention`: two autograd Functions.

Layout used throughout: q (b, H, s_q, d), k/v (b, Hkv, s_k, d) with H = Hkv * G (grouped-query
attention when G > 1). A query block of rows i0:i1 is copied to a contiguous (b*Hkv, G*bs, d)
tensor, so ``bmm`` against k (b*Hkv, s_k, d) serves all G query heads of a key head at once
(K/V are never repeated) and ``bmm`` with a transposed score block sums dK/dV over the group.
The score block (b*Hkv, G*bs, kend) is then the same memory as (b, H, bs, kend), which is how
masks, the causal triangle and the dropout indices address it. Work runs in float32 for 16-bit
inputs and float64 for float64 inputs.

Dropout: element (n, h, i, j) of the virtual (b, H, s_q, s_k) probability matrix is kept iff
``keep_mask(seed, ((n*H + h)*s_q + i)*s_k + j, p)``; every block regenerates its own part, so
forward and backward use the same mask whatever the block sizes. The factor 1/(1-p) is applied
to the small (rows x d) products, not to the score blocks.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import fake_rules
from ..amp import no_autocast_backward
from ..backward import once_differentiable
from ..dropout import launchers as _dropout_launchers
from ..random import CHUNK, _rounds32_, _signed32, keep_mask, keep_threshold, seed_keys

_INF = math.inf
_COL: list[torch.Tensor] = []  # cached int32 arange for the eager CPU mask chunks


def _arange(n: int) -> torch.Tensor:
    if not _COL or _COL[0].numel() < n:
        _COL[:] = [torch.arange(max(n, CHUNK), dtype=torch.int32)]
    return _COL[0][:n]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _contig(x: torch.Tensor, c: torch.dtype) -> torch.Tensor:
    """x as a contiguous tensor of dtype c, in one copy (none when it already is: may alias x)."""
    return x.contiguous() if x.dtype == c else x.to(c, memory_format=torch.contiguous_format)


def _rows(x: torch.Tensor, i0: int, i1: int, c: torch.dtype, bk: int) -> torch.Tensor:
    """Rows i0:i1 of x (b, H, s, e) as a contiguous (b*Hkv, G*bs, e) tensor of dtype c (may alias x)."""
    return _contig(x[:, :, i0:i1], c).view(bk, -1, x.size(-1))


def _kv(x: torch.Tensor, c: torch.dtype) -> torch.Tensor:
    """k or v (b, Hkv, s_k, e) as contiguous (b*Hkv, s_k, e) of dtype c (may alias x)."""
    return _contig(x, c).flatten(0, 1)


def _additive(mask, c):
    """A bool mask without a query dimension (a padding mask: small) as an additive 0/-inf float
    mask, since adding is several times faster than ``masked_fill``; other masks unchanged."""
    if mask is None or mask.dtype != torch.bool or mask.size(2) > 1:
        return mask
    return torch.zeros(mask.shape, dtype=c, device=mask.device).masked_fill_(mask.logical_not(), -_INF)


def is_segments(mask) -> bool:
    """Whether ``mask`` is a segment-id mask: an integer (b, s_q + s_k) tensor, the queries' ids then
    the keys' (query i attends key j only where the ids are equal). O(b·s) instead of s²: the
    block's part is made from the ids."""
    return mask is not None and mask.dim() == 2 and not mask.is_floating_point() and mask.dtype != torch.bool


def _logits(qs, kc, mask, causal, i0, i1, kend, b, h, softcap=None, tanh_out=None, window=None):
    """Scores of query rows i0:i1 against keys 0:kend: S (b*Hkv, G*bs, kend) and its (b, H, bs, kend) view.

    With ``softcap`` c the scores are c·tanh(S/c) (Gemma 2), before masking; ``tanh_out`` (a list)
    then receives tanh(S/c) (for the backward's factor 1 - tanh²). Masked entries are -inf (bool mask
    False, segment ids that differ (:func:`is_segments`), the causal triangle j > i, keys j <= i -
    ``window``); a float mask is added.
    """
    s = torch.bmm(qs, kc[:, :kend].transpose(1, 2))
    if softcap is not None:
        s.div_(softcap).tanh_()
        if tanh_out is not None:
            tanh_out.append(s.clone())
        s.mul_(softcap)
    s4 = s.view(b, h, i1 - i0, kend)
    if is_segments(mask):
        s_q = mask.size(1) - kc.size(1)
        s4.masked_fill_((mask[:, i0:i1, None] != mask[:, None, s_q:s_q + kend]).unsqueeze(1), -_INF)
    elif mask is not None:
        mb = (mask[:, :, i0:i1] if mask.size(2) > 1 else mask)[..., :kend]
        if mask.dtype == torch.bool:
            s4.masked_fill_(mb.logical_not(), -_INF)
        else:
            s4.add_(mb)
    if causal:
        above = torch.arange(kend, device=s.device) > torch.arange(i0, i1, device=s.device).unsqueeze(1)  # j > i
        s4.masked_fill_(above, -_INF)
    if window is not None:  # keys j <= i - window (a sliding window)
        rows = torch.arange(i0 - window, i1 - window, device=s.device).unsqueeze(1)
        behind = torch.arange(kend, device=s.device) <= rows
        s4.masked_fill_(behind, -_INF)
    return s, s4


class _Dropper:
    """Keep-masks (as uint8 0/1: ``x * mask`` is 3x faster than ``masked_fill``) of blocks of the
    virtual (b, H, s_q, s_k) matrix.

    Block rows i0:i1, columns 0:kend are ranges of consecutive indices: one per (n, h) of length
    (i1-i0)*s_k when kend == s_k, else one per row of length kend. Eager on the CPU they are
    hashed in cache-sized chunks from Python-int seed keys (the high index word is 0 when the
    matrix has at most 2^32 elements); elsewhere through :func:`keep_mask` on the explicit indices.
    Both give ``keep_mask(seed, index, p)`` exactly (tests check it).
    """

    def __init__(self, seed, p, b, h, s_q, s_k, device):
        self.seed, self.p, self.thr, self.dims, self.device = seed, p, keep_threshold(p), (b * h, s_q, s_k), device
        # int32 lanes: every index (and every start + column sum) below 2^31, threshold below 2^32
        self.fast = (device.type == "cpu" and b * h * s_q * s_k < 1 << 31 and self.thr < 1 << 32
                     and not torch.compiler.is_compiling() and not is_fake(seed))
        if self.fast:
            self.keys = tuple(int(x) for x in seed_keys(seed))

    def __call__(self, i0: int, i1: int, kend: int) -> torch.Tensor:
        bh, s_q, s_k = self.dims
        dev, rows = self.device, i1 - i0
        starts = (torch.arange(bh, device=dev).mul_(s_q).unsqueeze(1) + torch.arange(i0, i1, device=dev)).mul_(s_k)
        if kend == s_k:
            starts, length = starts[:, 0], rows * s_k
        else:
            starts, length = starts.view(-1), kend
        if not self.fast:
            keep = _dropout_launchers.keep_mask_rows(self.seed, starts, length, self.thr)  # CUDA: one kernel
            if keep is None:
                keep = keep_mask(self.seed, starts.unsqueeze(1) + torch.arange(length, device=dev), self.p)
            return keep.view(torch.uint8).view(-1, rows, kend)
        k0, k1 = self.keys
        k0, thr = _signed32(k0), self.thr - (1 << 31)  # int32 lanes (see random._rounds32_)
        starts = starts.to(torch.int32)
        out = torch.empty((starts.numel(), length), dtype=torch.bool)
        col = _arange(min(length, CHUNK))
        step_r, step_c = max(1, CHUNK // length), min(length, CHUNK)
        for r0 in range(0, starts.numel(), step_r):
            r1 = min(r0 + step_r, starts.numel())
            for c0 in range(0, length, step_c):
                c1 = min(c0 + step_c, length)
                x = (starts[r0:r1].unsqueeze(1) + (col[: c1 - c0] + c0)).bitwise_xor_(k0)
                torch.ge(_rounds32_(x, k1), thr, out=out[r0:r1, c0:c1])
        return out.view(torch.uint8).view(-1, rows, kend)


def _mask_grad(dmask, ds4, i0, i1):
    """Add the score gradient of rows i0:i1 (keys 0:kend, kend < s_k under the causal triangle) into
    the mask gradient (summed over broadcast dims)."""
    mb, mh, mq, mk = dmask.shape
    kend = ds4.size(-1)
    if mq > 1:
        dmask[:, :, i0:i1, :kend] = ds4.sum_to_size(mb, mh, i1 - i0, kend)
    else:
        dmask[..., :kend].add_(ds4.sum_to_size(mb, mh, 1, kend))


def _block_starts(s_q: int, block: int) -> range:
    """First rows of the query blocks, in order (:mod:`leanact.estimate` runs fewer on fake tensors)."""
    return range(0, s_q, block)


def _safe_softmax_(s4, sink=None):
    """In place: s4 <- exp(s4 - m) per row; returns (rowmax m, rowsum, empty rows). Masked rows give 0.

    ``sink`` (1, H, 1, 1): one more logit per head in each row's denominator (attention sinks,
    GPT-OSS), with no value: rowsum includes exp(sink - m), and a row whose keys are all masked gives 0."""
    m = s4.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.masked_fill(m == -_INF, 0.0)
    s4.sub_(m).exp_()
    rowsum = s4.sum(-1, keepdim=True)
    if sink is not None:
        rowsum = rowsum + (sink - m).exp()
    return m, rowsum, rowsum == 0


def _sink4(sinks, h, c):
    """The (H,) sink logits as a (1, H, 1, 1) tensor of the compute dtype (None: no sinks)."""
    return None if sinks is None else sinks.detach().to(c).view(1, h, 1, 1)


def _setup(q, k, v, p):
    b, h, s_q, d = q.shape
    c = compute_dtype(q.dtype)
    return b, h, s_q, d, k.size(1), k.size(2), v.size(-1), b * k.size(1), c, (1.0 / (1.0 - p) if p < 1 else 0.0)


def recompute_forward(q, k, v, mask, seed, p, causal, scale, block, softcap=None, sinks=None, window=None):
    """:class:`RecomputeAttention`'s forward: the output (b, s_q, H, dv) (its transpose(1, 2) is the
    (b, H, s_q, dv) result) and the per-row log-sum-exp (b, H, s_q) in the compute dtype."""
    b, h, s_q, d, hkv, s_k, dv, bk, c, inv = _setup(q, k, v, p)
    kc, vc, amask = _kv(k, c), _kv(v, c), _additive(mask, c)
    dropper = _Dropper(seed, p, b, h, s_q, s_k, q.device) if p > 0 else None
    sink = _sink4(sinks, h, c)
    out = q.new_empty((b, s_q, h, dv))
    o4 = out.transpose(1, 2)
    lse = q.new_empty((b, h, s_q), dtype=c)
    for i0 in _block_starts(s_q, block):
        i1 = min(i0 + block, s_q)
        kend = min(s_k, i1) if causal else s_k  # causal: keys beyond the block's last row are all masked
        s, s4 = _logits(_rows(q, i0, i1, c, bk).mul(scale), kc, amask, causal, i0, i1, kend, b, h, softcap,
                        window=window)
        m, rowsum, empty = _safe_softmax_(s4, sink)
        lse[:, :, i0:i1] = (m + rowsum.log()).masked_fill_(empty, _INF).squeeze(-1)
        r = rowsum.reciprocal().masked_fill_(empty, 0.0)
        if dropper is not None:
            s.mul_(dropper(i0, i1, kend).view(s.shape))
            r.mul_(inv)
        o4[:, :, i0:i1] = torch.bmm(s, vc[:, :kend]).view(b, h, i1 - i0, dv).mul_(r)
    return out, lse


def recompute_backward(dout, q, k, v, lse, mask, seed, sinks, p, causal, scale, block, softcap=None,
                       mask_grad=False, sinks_grad=False, window=None):
    """:class:`RecomputeAttention`'s backward from ``dout`` (b, s_q, H, dv) and what it keeps:
    (dq, dk, dv, dmask or None, dsinks or None)."""
    b, h, s_q, d, hkv, s_k, dv, bk, c, inv = _setup(q, k, v, p)
    kc, vc, amask = _kv(k, c), _kv(v, c), _additive(mask, c)
    dropper = _Dropper(seed, p, b, h, s_q, s_k, q.device) if p > 0 else None
    sink = _sink4(sinks, h, c)
    dsink = torch.zeros((1, h, 1, 1), dtype=c, device=q.device) if sinks_grad else None
    do4 = dout.transpose(1, 2)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros((bk, s_k, d), dtype=c, device=q.device)
    dvv = torch.zeros((bk, s_k, dv), dtype=c, device=q.device)
    dmask = torch.zeros(mask.shape, dtype=c, device=q.device) if mask_grad else None
    # With dropout, dS = P * (inv * dP' - D) = inv * P * (dP' - D / inv), dP' = (dO V^T) * keep:
    # the factor inv goes on the (rows x d) products. p = 1 (inv = 0): everything but dV is 0.
    dscale = inv if dropper is not None else 1.0
    for i0 in _block_starts(s_q, block):
        i1 = min(i0 + block, s_q)
        kend = min(s_k, i1) if causal else s_k
        qs = _rows(q, i0, i1, c, bk).mul(scale)
        tanh = [] if softcap is not None else None
        s, s4 = _logits(qs, kc, amask, causal, i0, i1, kend, b, h, softcap, tanh, window)
        lse_b = lse[:, :, i0:i1].unsqueeze(-1)
        s4.sub_(lse_b).exp_()  # P; rows with lse = +inf (fully masked) give 0
        dob = _rows(do4, i0, i1, c, bk)
        dp = torch.bmm(dob, vc[:, :kend].transpose(1, 2))  # gradient of the dropout output
        if dropper is not None:
            keep = dropper(i0, i1, kend).view(s.shape)
            dvv[:, :kend].baddbmm_((s * keep).transpose(1, 2), dob, alpha=inv)
            dp.mul_(keep)
        else:
            dvv[:, :kend].baddbmm_(s.transpose(1, 2), dob)
        # D / dscale = rowsum(P * dP') in the compute dtype: the same value as rowsum(dO * O) / dscale,
        # without the rounding of a 16-bit O (which cancels badly where dP' is close to D).
        dd = (s * dp).sum(-1, keepdim=True)
        if dsink is not None:  # d sink_h = -sum over rows of P_sink * D, P_sink = exp(sink - lse)
            psink = (sink - lse_b).exp_()  # (b, H, bs, 1); 0 where lse = +inf
            dsink.sub_((psink * dd.view(b, h, i1 - i0, 1)).sum((0, 2), keepdim=True), alpha=dscale)
        ds = dp.sub_(dd).mul_(s)  # dS / dscale
        if dmask is not None:  # (the mask is added after the softcap: its gradient is dS itself)
            _mask_grad(dmask, ds.view(b, h, i1 - i0, kend).mul(dscale), i0, i1)
        if tanh is not None:  # through c·tanh(S/c): times 1 - tanh²(S/c)
            ds.mul_(tanh[0].square_().neg_().add_(1.0))
        dq[:, :, i0:i1] = torch.bmm(ds, kc[:, :kend]).mul_(scale * dscale).view(b, h, i1 - i0, d)
        dk[:, :kend].baddbmm_(ds.transpose(1, 2), qs, alpha=dscale)
    dk, dvv = dk.view(k.shape).to(k.dtype), dvv.view(v.shape).to(v.dtype)
    dsinks = dsink.view(h).to(sinks.dtype) if dsink is not None else None
    return dq, dk, dvv, (dmask.to(mask.dtype) if dmask is not None else None), dsinks


class RecomputeAttention(torch.autograd.Function):
    """Flash-style attention. Saves q, k, v (the caller's tensors), the per-row log-sum-exp
    (b, H, s_q) and the seed (plus the caller's mask and the (H,) sinks, if any): nothing of size
    s², not the output. Backward recomputes each query block's probabilities as exp(S - lse) and its
    dropout mask, and D = rowsum(P * dP) from them in fp32 (the kept output is not read: a 16-bit O
    would round D).

    ``softcap`` c: scores c·tanh(S/c) before the mask (Gemma 2); backward multiplies dS by
    1 - tanh²(S/c), recomputed with the block. ``sinks`` (H,): a per-head logit added to each row's
    softmax denominator (GPT-OSS); the lse includes it, and its gradient is -Σ P_sink·D."""

    @staticmethod
    def forward(ctx, q, k, v, mask, seed, p, causal, scale, block, softcap=None, sinks=None, window=None):
        out, lse = recompute_forward(q, k, v, mask, seed, p, causal, scale, block, softcap, sinks, window)
        lse._leanact_exact = True  # a softmax statistic: lossy compression must leave it exact
        ctx.save_for_backward(q, k, v, lse, mask, seed, sinks)
        ctx.args = (p, causal, scale, block, softcap)
        ctx.window = window
        return out

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, dout):
        q, k, v, lse, mask, seed, sinks = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = recompute_backward(dout, q, k, v, lse, mask, seed, sinks, *ctx.args, needs[3],
                                   len(needs) > 10 and needs[10], ctx.window)
        return (*grads[:4], None, None, None, None, None, None, grads[4], None)[: len(needs)]


class TempoAttention(torch.autograd.Function):
    """Tempo's attention: saves q, k, v, the softmax output P (input dtype, (b, H, s_q, s_k)) and
    the seed; backward regenerates the dropout mask and recomputes P * mask / (1 - p) from P.
    Neither the mask nor the dropout output nor the attention output is kept."""

    @staticmethod
    def forward(ctx, q, k, v, mask, seed, p, causal, scale, window=None):
        b, h, s_q, d, hkv, s_k, dv, bk, c, inv = _setup(q, k, v, p)
        s, s4 = _logits(_rows(q, 0, s_q, c, bk).mul(scale), _kv(k, c), _additive(mask, c), causal, 0, s_q, s_k, b, h,
                        window=window)
        _, rowsum, empty = _safe_softmax_(s4)
        s4.mul_(rowsum.reciprocal().masked_fill_(empty, 0.0))
        pk = s.to(q.dtype)  # kept: P rounded to the input dtype; the forward uses the rounded values too
        keep = _Dropper(seed, p, b, h, s_q, s_k, q.device)(0, s_q, s_k).view(s.shape)
        o = torch.bmm((pk * keep).to(c), _kv(v, c)).mul_(inv)
        out = q.new_empty((b, s_q, h, dv))
        out.transpose(1, 2)[:] = o.view(b, h, s_q, dv)
        ctx.save_for_backward(q, k, v, pk.view(b, h, s_q, s_k), seed)
        ctx.args = (p, causal, scale)
        ctx.mask_meta = None if mask is None else (mask.shape, mask.dtype)  # the mask itself is not needed
        return out

    @staticmethod
    @once_differentiable
    @no_autocast_backward
    def backward(ctx, dout):
        q, k, v, pk, seed = ctx.saved_tensors
        p, causal, scale = ctx.args
        b, h, s_q, d, hkv, s_k, dv, bk, c, inv = _setup(q, k, v, p)
        pc = pk.to(c).view(bk, -1, s_k)  # may alias the saved P: only read from here on
        keep = _Dropper(seed, p, b, h, s_q, s_k, q.device)(0, s_q, s_k).view(pc.shape)
        dob = _rows(dout.transpose(1, 2), 0, s_q, c, bk)
        ddv = torch.bmm((pc * keep).transpose(1, 2), dob).mul_(inv)
        ds = torch.bmm(dob, _kv(v, c).transpose(1, 2)).mul_(keep).mul_(pc)
        ds.addcmul_(pc, ds.sum(-1, keepdim=True), value=-1.0)  # dS / inv = P * (dP' - rowsum(P * dP'))
        dmask = None
        if ctx.needs_input_grad[3]:
            mshape, mdtype = ctx.mask_meta
            dmask = ds.view(b, h, s_q, s_k).sum_to_size(mshape).mul(inv).to(mdtype)
        dq = torch.bmm(ds, _kv(k, c)).mul_(scale * inv).view(q.shape).to(q.dtype)
        dk = torch.bmm(ds.transpose(1, 2), _rows(q, 0, s_q, c, bk)).mul_(scale * inv).view(k.shape).to(k.dtype)
        return dq, dk, ddv.view(v.shape).to(v.dtype), dmask, None, None, None, None, None


# -- on fake tensors (leanact.estimate) ----------------------------------------------------------


@contextlib.contextmanager
def _fake_rule(run):
    """On fake tensors: the loops over query blocks run their last three blocks only (the largest:
    causal blocks grow, the last one may be ragged; outputs are allocated before the loops, so the
    allocations and the peak are the full loop's); modelling the CPU, the dropout blocks of fake
    CPU tensors allocate what the eager CPU path allocates (the bool block, the start indices, one
    block of int32 words and a slice of the per-process arange), not the generic path's int64 words
    (the eager path reads the seed as Python ints, which a fake seed does not have)."""
    starts, call = _block_starts, _Dropper.__call__

    def last_blocks(s_q: int, block: int):
        return starts(s_q, block)[-3:] if fake_rules.faking() else starts(s_q, block)

    def dropper_call(self, i0, i1, kend):
        bh, s_q, s_k = self.dims
        if self.fast or not is_fake(self.seed) or self.device.type != "cpu" or bh * s_q * s_k >= 1 << 31:
            return call(self, i0, i1, kend)
        rows = i1 - i0
        n, length = (bh, rows * s_k) if kend == s_k else (bh * rows, kend)
        out = torch.empty((n, length), dtype=torch.bool)
        # the (bh, rows) start indices, then per block the column indices and the hash words
        tmp = [torch.empty((bh, rows), dtype=torch.int64), torch.empty((bh, rows), dtype=torch.int32),
               torch.empty(min(n * length, CHUNK), dtype=torch.int32),
               torch.empty(min(n * length, CHUNK), dtype=torch.int32)]
        del tmp
        fake_rules.hold_slice(run, lambda: _arange(min(length, CHUNK)))
        return out.view(torch.uint8).view(-1, rows, kend)

    with fake_rules.swapped(sys.modules[__name__], _block_starts=last_blocks if run.fewer_iterations else None), \
            fake_rules.swapped(_Dropper, __call__=dropper_call if run.kind == "cpu" else None):
        yield


def _prepare() -> None:
    """The per-process CPU cache of the dropout blocks' hash (an arange of CHUNK elements), created
    before a measured step."""
    _arange(CHUNK)


fake_rules.register("attention core", rule=_fake_rule, prepare=_prepare)
