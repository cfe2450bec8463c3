"""TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``: per-token log-probabilities, entropy and
statistics of ``hidden @ weightᵀ`` in tiles, no logits) with a backward that holds no fp32 copy of
the weight's gradient.

TRL's backward walks token chunks, and inside each the vocabulary in tiles, summing every tile's
weight gradient into one fp32 buffer of the weight's size, cast to the weight's dtype at the end:
for a 16-bit weight the step's peak then holds V·H·4 bytes of accumulator and the V·H·2 bytes of
the cast together (1.5 GiB at Llama-3.2-1B's vocabulary and width), which is the whole step's peak
under TRL's own gradient checkpointing. :class:`LeanChunkedLogProb` keeps TRL's forward (what it
keeps for backward is TRL's: the hidden states, the weight, the targets and an fp32 log-sum-exp per
token) and runs the same tiles, kernels and fp32 products in the other order: the vocabulary outer,
each tile's rows of the weight gradient summed in fp32 over the token chunks in a buffer of one
tile's rows, then written once in the weight's dtype. Every sum runs over the same terms in the
same order as TRL's, so the gradients are TRL's bit for bit; the transient is one tile's rows of
fp32 (chunk_size · H · 4 bytes) instead of the weight's size. On a CPU, TRL's torch fold of a tile
(several fp32 temporaries of the tile's size) runs on slices of rows: it is elementwise, the same bits.

Tied weights (:mod:`leanact.ops.embedding`): the weight's gradient is handed to the embedding's node,
which adds its token rows into it. With ``late_weight_grad`` (what :mod:`leanact.patching.trl_head`
asks for under gradient checkpointing) the backward computes only the hidden states' gradient, and
the weight's is computed inside the embedding's backward, at the end, so that it is not held while
the layers' backward runs: one more pass of the logits over the vocabulary (one matmul of the
head's size) in tiles of 4,096 vocabulary rows, whose buffers are 1/8 of TRL's. Its sums are
TRL's; the smaller tiles can round the recomputed logits differently (fp32 products rounded to the
compute dtype), so that gradient equals TRL's to the dtype's rounding, not bit for bit.

Which TRL it serves: :func:`compatible` checks that ``trl.kernels.chunked_logprob`` has the
functions and the tile signature this backward calls; a ctx that lacks what TRL's forward stores
runs TRL's own backward.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from ..embedding.tied_grad import give, hand_off, receiver

__all__ = ["compatible", "lean_class"]

#: the per-tile fold's parameters, in the order TRL's backward passes them
_TILE_PARAMS = ("tile", "tile_stride", "targets", "log_z", "entropy", "grad_logprobs", "grad_entropy",
                "vocab_start", "n_cols", "logit_scale", "softcap", "inv_t", "HAS_SOFTCAP", "HAS_LOGPROB_GRAD",
                "HAS_ENTROPY_GRAD", "BLOCK_SIZE")
_NAMES = ("ChunkedLogProbFunction", "TOKEN_CHUNK_SIZE", "_BLOCK_SIZE", "_backward_kernel", "_backward_tile",
          "_addmm_fp32", "_use_triton")
_CLASS: dict[tuple[int, bool], type] = {}
#: elements of one call of TRL's torch fold (16 MiB per fp32 temporary)
_FOLD_ELEMENTS = 2**22
#: vocabulary rows per tile of the late weight gradient (module doc): its tile of logits and its fp32
#: rows are then 32 MiB each at 4096 tokens and H = 2048, not 256 MiB each at TRL's 32768
_LATE_TILE = 4096


def compatible(module: Any) -> str | None:
    """None if ``module`` (``trl.kernels.chunked_logprob``) is what this backward is written for, else why not."""
    missing = [n for n in _NAMES if not hasattr(module, n)]
    if missing:
        return f"trl.kernels.chunked_logprob has no {', '.join(missing)}"
    try:
        params = tuple(inspect.signature(module._backward_tile).parameters)
    except (TypeError, ValueError):
        return "the signature of TRL's tile fold cannot be read"
    if params != _TILE_PARAMS:
        return f"TRL's tile fold takes {params}, not {_TILE_PARAMS}"
    return None


def lean_class(module: Any, late_weight_grad: bool = False) -> type:
    """The subclass of ``module.ChunkedLogProbFunction`` with the backward above (one per module and
    ``late_weight_grad``: the weight's gradient computed in a tied embedding's backward, module doc)."""
    key = (id(module), late_weight_grad)
    if key not in _CLASS:
        def backward(ctx, *grads):
            return _backward(module, ctx, *grads, late=late_weight_grad)

        _CLASS[key] = type("LeanChunkedLogProb", (module.ChunkedLogProbFunction,), {
            "__doc__": __doc__.split("\n\n")[0], "__module__": __name__, "backward": staticmethod(backward)})
    return _CLASS[key]


def _backward(trl, ctx, grad_logprobs, grad_entropy, *rest, late=False):
    """TRL's gradients, vocabulary tiles outer (module doc). TRL's own backward runs where its forward
    kept something else than what this one reads, or where an output other than the log-probabilities
    and the entropy receives a gradient (TRL marks them non-differentiable; a TRL that did not would
    need its own backward's terms)."""
    if (not all(hasattr(ctx, a) for a in ("compute_dtype", "chunk_size", "kernel_args"))
            or len(ctx.saved_tensors) != 6 or any(g is not None for g in rest)):
        return trl.ChunkedLogProbFunction.backward(ctx, grad_logprobs, grad_entropy, *rest)
    hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    g_lp = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
    g_ent = grad_entropy.float().contiguous() if grad_entropy is not None else None
    tiles = functools.partial(_tiles, trl, hidden, weight, bias, targets, log_z, entropy, g_lp, g_ent,
                              ctx.compute_dtype, ctx.chunk_size, ctx.kernel_args)
    node = receiver(ctx, 1) if late and need_w else None
    if (node is not None and tuple(weight.shape) == tuple(node.leanact_weight_shape)
            and weight.dtype == node.leanact_weight_dtype):
        grad_hidden, _, grad_bias = tiles(need_h, False, need_b) if need_h or need_b else (None, None, None)
        late = functools.partial(_tiles, trl, hidden, weight, bias, targets, log_z, entropy, g_lp, g_ent,
                                 ctx.compute_dtype, min(ctx.chunk_size, _LATE_TILE), ctx.kernel_args)
        give(node, lambda: late(False, True, False)[1])
        grad_weight = None
    else:
        grad_hidden, grad_weight, grad_bias = tiles(need_h, need_w, need_b)
        grad_weight = hand_off(ctx, 1, grad_weight)
    return (grad_hidden.to(hidden.dtype) if need_h else None, grad_weight,
            grad_bias.to(bias.dtype) if need_b else None, None, None, None, None, None, None)


def _tiles(trl, hidden, weight, bias, targets, log_z, entropy, g_lp, g_ent, cdtype, chunk, kernel_args,
           need_h, need_w, need_b):
    """(fp32 dx, dW in the weight's dtype, fp32 db), each None where not asked: the vocabulary tiles
    outer, the token chunks inner."""
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    n_tok, rows = hidden.shape[0], trl.TOKEN_CHUNK_SIZE
    with maybe_gather_lm_head_ctx(weight, bias):
        vocab = weight.shape[0]
        f32 = torch.float32
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=f32) if need_h else None
        # In the weight's dtype from the start; fp32 accumulation per tile's rows below (fp32 weights: in place)
        grad_weight = torch.empty(weight.shape, device=weight.device, dtype=weight.dtype) if need_w else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=f32) if need_b else None
        buf = torch.empty((min(n_tok, rows), chunk), device=hidden.device, dtype=cdtype)
        acc_buf = (torch.empty((min(vocab, chunk), weight.shape[1]), device=weight.device, dtype=f32)
                   if need_w and weight.dtype != f32 else None)
        use_triton = trl._use_triton(hidden.device)
        block = trl._BLOCK_SIZE
        for start in range(0, vocab, chunk):
            end = min(start + chunk, vocab)
            width = end - start
            w_tile = weight[start:end].to(cdtype)
            acc = None
            if need_w:
                acc = grad_weight[start:end] if acc_buf is None else acc_buf[:width]
                acc.zero_()
            for t0 in range(0, n_tok, rows):
                t1 = min(t0 + rows, n_tok)
                h_chunk = hidden[t0:t1].to(cdtype)
                tile = buf[: t1 - t0, :width]
                torch.mm(h_chunk, w_tile.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[start:end].to(cdtype))
                # TRL's torch fold (no Triton: CPUs) makes several fp32 temporaries of the tile's size (3.5 GiB
                # at 4096 tokens × 32768 columns): run it on slices of rows (it is elementwise: the same bits)
                step = (t1 - t0) if use_triton else max(1, _FOLD_ELEMENTS // width)
                for r0 in range(t0, t1, step):
                    r1 = min(r0 + step, t1)
                    part = tile[r0 - t0:r1 - t0]
                    fold = trl._backward_kernel[(r1 - r0, -(-width // block))] if use_triton else trl._backward_tile
                    fold(part, part.stride(0), targets[r0:r1], log_z[r0:r1], entropy[r0:r1],
                         g_lp[r0:r1] if g_lp is not None else log_z, g_ent[r0:r1] if g_ent is not None else log_z,
                         start, width, HAS_LOGPROB_GRAD=g_lp is not None, HAS_ENTROPY_GRAD=g_ent is not None,
                         BLOCK_SIZE=block, **kernel_args)
                if need_h:
                    trl._addmm_fp32(grad_hidden[t0:t1], tile, w_tile)
                if need_w:
                    trl._addmm_fp32(acc, tile.t(), h_chunk)
                if need_b:
                    grad_bias[start:end] += tile.sum(dim=0, dtype=f32)
            if acc_buf is not None:
                grad_weight[start:end].copy_(acc)
    return grad_hidden, grad_weight, grad_bias
