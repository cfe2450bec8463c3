"""Context parallelism (DeepSpeed-Ulysses): the sequence split over ranks, attention by all-to-all.

>>> model = leanact.parallel.context_parallel(leanact.patch(model), group)   # every rank
>>> loss = model(input_ids=ids, labels=ids).loss      # the same full batch on every rank
>>> loss.backward(); leanact.parallel.average_gradients(model, group); opt.step()

Each of the P ranks of ``group`` runs the model on its contiguous 1/P of the sequence: embeddings,
norms, MLPs, residual adds and the (fused) head on s/P tokens. Attention needs every token, so
around each attention call (:func:`leanact.patching.attention_hf` with the exchange in its keyword
arguments) q, k and v go through an all-to-all from (all heads, s/P tokens) to (H/P heads, all s
tokens), leanact's attention runs on that with the whole sequence's mask, and its output goes back
by the inverse all-to-all. Nothing is gathered whole: per rank the layer keeps what the
single-process layer keeps at s/P tokens (the exchanged q, k, v, output are H/P heads × s tokens,
the same bytes). Key/value heads that do not divide by P are repeated to lcm(Hkv, P) first.

The wrapped ``forward`` takes the full batch (every rank the same, as for tensor parallelism), cuts
each rank's shard (``input_ids``/``inputs_embeds``, ``position_ids``, ``token_type_ids``,
``labels``) and keeps the whole-sequence ``attention_mask`` (padding) and the ``position_ids``
restarts (packed sequences, always kept apart) for the attention masks. The loss is exact: a causal
LM gets its labels shifted over the whole sequence before the cut (``shift_labels``) and the global
count of predicted tokens as ``num_items_in_batch`` (the caller's, when given, is respected); a
masked LM's per-rank mean is reweighted by its count. The returned ``loss`` is the global loss on
every rank; its gradient on each rank is P times that rank's share, so the *average* of the ranks'
gradients is the exact gradient: what DDP and FSDP2 compute over a group that includes the
context-parallel ranks, or :func:`average_gradients` alone. Logits (when not fused away) and hidden
states come back for the rank's own tokens.

Dropout: every rank draws from a generator forked per rank (a synchronised draw mixed with the
rank) inside the forward, so ranks drop independently; torch.utils.checkpoint's recompute redraws
the same masks. The masks are not the single-process model's.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..ops.random import draw_seed
from ..patching.attention_hf import EXCHANGE, NAME, local_masks_off
from ..recompute.context_forward import ContextForward
from .dropout import _generator_state, _mix

__all__ = ["context_parallel", "average_gradients", "SequenceExchange", "SimulatedGroup", "SUPPORTED_CONTEXT"]

#: config.model_type -> how the model's head reads its labels ("causal": shifted, "masked": as they are)
SUPPORTED_CONTEXT = {"llama": "causal", "mistral": "causal", "qwen2": "causal", "qwen3": "causal",
                     "gpt2": "causal", "bert": "masked"}
_SHARDED = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "labels")


class SimulatedGroup:
    """A stand-in for a process group of ``size`` ranks, seen from rank ``rank``, for predictions
    on fake tensors (``leanact.estimate(..., context_parallel=P)``): the collectives allocate
    their results and communicate nothing."""

    def __init__(self, size: int, rank: int = 0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or not 0 <= rank < size:
            raise ValueError(f"SimulatedGroup: need a size >= 1 and 0 <= rank < size, got size={size!r}, rank={rank!r}")
        self.size, self.rank = size, rank


def _size(group) -> int:
    return group.size if isinstance(group, SimulatedGroup) else dist.get_world_size(group)


def _rank(group) -> int:
    return group.rank if isinstance(group, SimulatedGroup) else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` in P pieces along ``scatter_dim``, send piece j to rank j, and join the pieces
    received from ranks 0..P-1 along ``gather_dim``."""
    send = x.unflatten(scatter_dim, (_size(group), -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    if not isinstance(group, SimulatedGroup):
        dist.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """All-to-all with autograd (its adjoint is the inverse all-to-all); keeps nothing."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, dy):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all(dy, group, gather_dim, scatter_dim), None, None, None


def _packed(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Sequence number of each token where ``position_ids`` restart inside a row (packed
    sequences, as transformers finds them), else None."""
    if position_ids is None:
        return None
    if is_fake(position_ids):  # (a prediction: counted as packed, the mask's bytes included)
        return torch.zeros_like(position_ids).cumsum(-1)
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    starts = step != 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.cumsum(-1)


class SequenceExchange:
    """One forward's exchange: q, k, v of the local shard ↔ this rank's heads of the whole
    sequence (:meth:`gather`, :meth:`scatter`), and the whole sequence's attention mask as segment ids
    (:meth:`mask`, O(b·s), made once and shared by the layers). ``padding`` (b, s) bool, True =
    a real token; ``segments`` (b, s) the packed-sequence number of each token."""

    def __init__(self, group, length: int, padding: torch.Tensor | None, segments: torch.Tensor | None):
        if padding is not None and segments is not None and padding.shape != segments.shape:
            segments = segments.expand(padding.shape)
        self.group, self.length, self.padding, self.segments = group, length, padding, segments
        self.size = _size(group)
        self._masks: dict = {}

    def gather(self, q, k, v):
        """(b, H, s/P, d) each -> (b, H/P, s, d), a view of a (b, s, H/P, d) buffer as the model's own
        q, k, v are (so attention kernels see the layout they see in one process); key/value heads
        repeated to a multiple of P first."""
        repeat = self.size // math.gcd(k.shape[1], self.size)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        return tuple(_AllToAll.apply(x.transpose(1, 2), self.group, 2, 1).transpose(1, 2) for x in (q, k, v))

    def scatter(self, out):
        """The attention output (b, s, H/P, d) -> (b, s/P, H, d)."""
        return _AllToAll.apply(out, self.group, 1, 2)

    def mask(self, causal: bool, window: int | None, device) -> tuple[torch.Tensor | None, int | None]:
        """The whole sequence's mask as leanact's attention core takes it, O(b·s) bytes: (segment ids
        (b, 2s) — the queries' then the keys', equal ids attend — or None, the sliding window or None).
        transformers' rules: causal (the core's ``is_causal``), window ``j > i - window``, padded keys
        (an id no query has), packed sequences apart. Made once per device and shared by the layers."""
        window = window if causal and window is not None and window < self.length else None
        if self.padding is None and self.segments is None:
            return None, window
        if device not in self._masks:
            b, s = self.padding.shape if self.padding is not None else self.segments.shape
            seg = (self.segments.to(device) if self.segments is not None
                   else torch.zeros((b, s), dtype=torch.int64, device=device))
            keys = seg if self.padding is None else seg.masked_fill(~self.padding.to(device), -1)
            self._masks[device] = torch.cat([seg, keys], 1).to(torch.int32)
        return self._masks[device], window

    def dead_rows(self, causal: bool, window: int | None, device) -> torch.Tensor | None:
        """(b, 1, s) bool: the queries that attend no key under :meth:`mask` (only padding makes them:
        a query sees itself otherwise), or None where there are none. O(b·s): segments are runs."""
        window = window if causal and window is not None and window < self.length else None
        if self.padding is None:
            return None
        key = ("dead", causal, window, device)
        if key not in self._masks:
            valid = self.padding.to(device)
            b, s = valid.shape
            seg = (self.segments.to(device) if self.segments is not None
                   else torch.zeros((b, s), dtype=torch.int64, device=device))
            i = torch.arange(s, device=device).expand(b, s)
            if causal:  # the last real key at or before i: it is seen iff in i's segment (and window)
                last = torch.where(valid, i, -1).cummax(-1).values
                seen = (last >= 0) & (seg.gather(1, last.clamp(min=0)) == seg)
                if window is not None:
                    seen &= last > i - window
            else:  # any real key in i's segment
                count = torch.zeros((b, s + 1), dtype=torch.int64, device=device).scatter_add_(1, seg, valid.long())
                seen = count.gather(1, seg) > 0
            dead = ~seen[:, None]
            self._masks[key] = dead if is_fake(dead) or bool(dead.any()) else None
        return self._masks[key]


class _GlobalLoss(torch.autograd.Function):
    """Forward: the all-reduced ``total``; backward: P × the gradient to the rank's ``part``."""

    @staticmethod
    def forward(ctx, part, total, size):
        ctx.size = size
        return total.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.size, None, None


def _heads(config) -> tuple[int, int]:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _attention_implementations(model: nn.Module) -> set:
    """The attention implementations named by the configs of ``model``'s modules."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    return {c._attn_implementation for c in configs.values() if hasattr(c, "_attn_implementation")}


def _check(model: nn.Module, size: int) -> str | None:
    """What :func:`context_parallel` refuses (module doc); returns how the model's head reads its
    labels ("causal", "masked") or None for a model without an LM head."""
    if isinstance(model.__dict__.get("forward"), _ContextForward):
        raise ValueError("leanact.parallel.context_parallel: the model is already context-parallel")
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_CONTEXT:
        raise ValueError(f"leanact.parallel.context_parallel: model type {family!r} is not supported; supported: "
                         f"{', '.join(sorted(SUPPORTED_CONTEXT))} (their label and position handling is tested)")
    kind = SUPPORTED_CONTEXT[family]
    name = type(model).__name__
    head = ("causal" if name.endswith(("ForCausalLM", "LMHeadModel")) else
            "masked" if name.endswith("ForMaskedLM") else None)
    if head is not None and head != kind:
        raise ValueError(f"leanact.parallel.context_parallel: {name} is not supported (a {kind} LM head is)")
    implementations = _attention_implementations(model)
    if implementations != {NAME}:
        raise ValueError("leanact.parallel.context_parallel: patch the model first (model = leanact.patch(model)): "
                         f"its attention must be leanact's, found {sorted(map(str, implementations))}")
    heads, _ = _heads(config)
    if heads % size:
        raise ValueError(f"leanact.parallel.context_parallel: {heads} attention heads do not divide by the "
                         f"group size {size}; use a group whose size divides the head count")
    return head


def context_parallel(model: nn.Module, group=None) -> nn.Module:
    """Run ``model`` (patched by :func:`leanact.patch`) context-parallel over ``group`` (default:
    the world; a :class:`SimulatedGroup` for predictions); returns ``model``, whose ``forward``
    now takes the full batch (module doc).

    Raises ValueError for a model that is not patched, of an unsupported family
    (:data:`SUPPORTED_CONTEXT`), already context-parallel, or whose attention heads do not divide
    by the group size.
    """
    if not isinstance(group, SimulatedGroup) and (not dist.is_available() or not dist.is_initialized()):
        raise ValueError("leanact.parallel.context_parallel: initialise torch.distributed first "
                         "(torch.distributed.init_process_group, e.g. under torchrun)")
    size = _size(group)
    head = _check(model, size)
    config = model.config
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(config, a, 0) or 0) > 0 for a in ("attention_dropout", "attention_probs_dropout_prob",
                                                          "attn_pdrop"))
    wrapper = _ContextForward(model, group, head, dropout, model.__dict__.get("forward"))
    model.__dict__["forward"] = wrapper
    return model


class _ContextForward(ContextForward):
    """The model's ``forward`` (set on the instance): the full batch in, the rank's shard run with
    the exchange, the global loss out; the model's local masks are off and the generator forked
    inside ``try``/``finally`` (nothing leaks on an exception or ``KeyboardInterrupt``)."""

    def __init__(self, module, group, head, dropout, previous):
        super().__init__(module, None, previous)
        self.group, self.head, self.dropout = group, head, dropout
        self.size, self.rank = _size(group), _rank(group)

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        implementation = getattr(self.module.config, "_attn_implementation", None)
        if implementation != NAME:  # (unpatched, or set_attn_implementation since: attention would stay local)
            raise ValueError(f"leanact.parallel.context_parallel: the model's attention is {implementation!r} now, "
                             "not leanact's; context parallelism needs it (leanact.patch the model again)")
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        for name, p in inspect.signature(forward).parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                call.update(call.pop(name, {}))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL and call.get(name):
                raise TypeError("leanact.parallel.context_parallel: pass the model's inputs by keyword")
        call, reduce = self._shard(call, "use_cache" in inspect.signature(forward).parameters)
        restore = None
        try:
            local_masks_off(True)
            if self.dropout and self.module.training:
                device = next(self.module.parameters()).device
                state, set_state, seed = _generator_state(device)
                restore = (set_state, state)
                seed(_mix(int(draw_seed(device)), self.rank))
            output = forward(**call)
        finally:
            local_masks_off(False)
            if restore is not None:
                restore[0](restore[1])
        return self._loss(output, *reduce)

    def _shard(self, call: dict, takes_use_cache: bool):
        if call.get("past_key_values") is not None:
            raise ValueError("leanact.parallel.context_parallel: a KV cache (past_key_values) is not supported; "
                             "generate with the model outside context parallelism")
        mask = call.pop("attention_mask", None)
        if mask is not None and mask.dim() != 2:
            raise ValueError("leanact.parallel.context_parallel: give attention_mask as (batch, seq) padding "
                             f"(1 = token, 0 = padding), got {mask.dim()}-D")
        tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
        if tokens is None:
            raise ValueError("leanact.parallel.context_parallel: pass input_ids or inputs_embeds")
        b, s = tokens.shape[:2]
        if s % self.size:
            raise ValueError(f"leanact.parallel.context_parallel: sequence length {s} does not divide by the "
                             f"group size {self.size}; pad the batch to a multiple of {self.size}")
        positions = call.get("position_ids")
        if positions is not None and (positions.dim() != 2 or positions.shape[1] != s):
            raise ValueError("leanact.parallel.context_parallel: give position_ids as (batch or 1, seq) for the "
                             f"whole sequence of {s} tokens, got shape {tuple(positions.shape)}")
        segments = _packed(positions)
        if positions is None:
            positions = torch.arange(s, device=tokens.device)[None]
        call["position_ids"] = positions.expand(b, s) if positions.shape[0] == 1 else positions
        padding = None if mask is None or (not is_fake(mask) and bool(mask.all())) else mask.bool()
        exchange = SequenceExchange(self.group, s, padding, segments)
        labels, reduce = call.get("labels"), (None, None)
        if labels is None and call.get("shift_labels") is not None:
            raise ValueError("leanact.parallel.context_parallel: pass labels with shift_labels (the model computes "
                             "its loss only when it gets labels)")
        if labels is not None and self.head is not None:
            if self.head == "causal":
                shifted = call.pop("shift_labels", None)
                if shifted is None:
                    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
                labels = shifted
                call["shift_labels"] = shifted  # the loss reads these (transformers' ForCausalLMLoss)
            count = call.pop("num_items_in_batch", None)
            count = (labels != -100).sum() if count is None else torch.as_tensor(count, device=labels.device)
            if self.head == "causal":
                call["num_items_in_batch"] = count  # each rank's loss: its sum / the global count
            call["labels"] = labels
            reduce = (count, None)
        lo, hi = self.rank * (s // self.size), (self.rank + 1) * (s // self.size)
        for key in _SHARDED:
            if call.get(key) is not None and call[key].dim() >= 2 and call[key].shape[1] == s:
                call[key] = call[key][:, lo:hi]
        if "shift_labels" in call:  # the same tensor as labels (one copy); transformers views it flat
            call["labels"] = call["shift_labels"] = call["labels"].contiguous()
        elif call.get("labels") is not None:
            call["labels"] = call["labels"].contiguous()
        if self.head == "masked" and reduce[0] is not None:
            reduce = (reduce[0], (call["labels"] != -100).sum())
        if takes_use_cache:
            call["use_cache"] = False
        call[EXCHANGE] = exchange
        return call, reduce

    def _loss(self, output, count, local):
        loss = output.get("loss") if isinstance(output, dict) else (output[0] if isinstance(output, tuple) else None)
        if count is None or loss is None:
            return output
        if local is not None:  # a masked LM's mean over its own tokens, as a share of the global mean
            part = torch.where(local > 0, loss * local, torch.zeros_like(loss)) / count
        else:  # a causal LM's sum over its tokens / the global count
            part = loss
        total = part.detach().clone()
        if not isinstance(self.group, SimulatedGroup):
            dist.all_reduce(total, group=self.group)
        loss = _GlobalLoss.apply(part, total, self.size)
        if isinstance(output, dict):
            output["loss"] = loss
            return output
        return (loss, *output[1:])


def average_gradients(model: nn.Module, group=None) -> None:
    """Average the gradients of ``model``'s trainable parameters over ``group`` in place (one
    all-reduce per dtype and device): the exact gradient of a context-parallel step, for a script
    without DDP or FSDP. A trainable parameter without a gradient counts as zeros."""
    size = dist.get_world_size(group)
    buckets: dict = {}
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
