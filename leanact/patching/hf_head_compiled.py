"""The fused language-model head while ``torch.compile`` traces the model.

The eager head (:mod:`.hf_head`) watches the logits with a ``TorchFunctionMode`` and swaps
placeholders in place when the loss code writes into them, which Dynamo cannot trace. While
compiling, an armed call's head returns :class:`LazyLogits` instead: the real logits (the head's
own forward, in the graph) as a tensor subclass whose ``__torch_function__`` Dynamo traces:

- upcasts, views/reshapes keeping the vocabulary dimension, multiplication/division by Python
  numbers and one ``tanh`` (soft-capping, a logit scale) give another ``LazyLogits``;
- ``F.cross_entropy`` (class-index targets, no class weights, reduction mean or sum) on one runs
  the custom op ``leanact::linear_cross_entropy`` (:mod:`leanact.ops.cross_entropy.custom_op`) on the
  head's input, weight and bias: the same loss and memory as the eager fused head. Nothing then
  uses the logits, and the compiler removes their computation from the graph;
- anything else runs on the real logits, and nothing more of this call is fused: its loss is the
  model's own. A write into them is a write into the real logits, seen by every tensor that shares
  them, exactly as in the unfused model.

Each ``LazyLogits`` is attached to the autograd graph of the logits it holds (:class:`_Attach`), so
code that reaches them without ``__torch_function__`` -- Dynamo rewrites a ``nn.CrossEntropyLoss()``
built inside the forward (BERT's masked LM) into a direct call, without dispatching -- computes the unfused loss and
its gradients: such a call is exact, not fused. The model returns ``logits=None`` when the loss was
fused, the real logits otherwise, as the eager head does. ``leanact.summary``'s counts of fused calls
and fallbacks are the eager head's (a compiled graph runs without Python).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.amp import autocast_dtype
from ..ops.cross_entropy.custom_op import linear_cross_entropy_op
from .head_writes import cast_dtype, fusable_call, name_of

__all__ = ["CompiledWindow", "LazyLogits"]

_META = {"shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "layout", "requires_grad", "is_leaf",
         "is_sparse", "is_quantized", "is_nested", "size", "dim", "__len__", "numel", "nelement", "ndimension",
         "is_floating_point", "get_device", "element_size", "is_complex", "grad_fn"}
_SHAPE = {"view", "reshape", "flatten", "contiguous"}
_CAST = {"float", "double", "to"}
_MUL = {"mul", "__mul__", "__rmul__", "multiply"}
_DIV = {"div", "__truediv__", "true_divide", "divide"}
_TANH = {"tanh"}


def _scalar(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)


class CompiledWindow:
    """One armed call while compiling: the head's input, whether the loss was fused and whether
    anything else used the logits."""

    def __init__(self, head: nn.Linear):
        self.head = head
        self.x = None
        self.ac = None
        self.made = False
        self.consumed = False
        self.unfused = False

    def capture(self, input):
        head = self.head
        head.__dict__.pop("forward", None)  # one call only
        logits = nn.Linear.forward(head, input)
        x, w = input, head.weight
        if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == head.in_features
                and x.is_floating_point() and (x.requires_grad or w.requires_grad) and x.device == w.device):
            return logits
        ac = autocast_dtype(x.device.type)
        if ac is None and (x.dtype != w.dtype or (head.bias is not None and head.bias.dtype != w.dtype)):
            return logits
        self.x, self.ac, self.made = x, ac, True
        return LazyLogits.attach(self, logits, ())

    def cross_entropy(self, args, kwargs):
        """The fused loss, or None when this call cannot be fused."""
        if self.unfused:
            return None
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        if len(args) > len(names) or any(k not in names for k in kwargs):
            return None
        a = {**dict(zip(names, args)), **kwargs}
        z, target = a.get("input"), a.get("target")
        if (not isinstance(z, LazyLogits) or z._window is not self or isinstance(target, LazyLogits)
                or a.get("reduction", "mean") not in ("mean", "sum")
                or not fusable_call(a, z, target, math.prod(self.x.shape[:-1]))):
            return None
        form = _logit_form(z._ops)
        if form is None:
            return None
        scale, softcap = form
        x = self.x.reshape(-1, self.x.shape[-1])
        head = self.head
        cdtype = self.ac if self.ac is not None else x.dtype
        if self.ac is not None:  # the op's input as autocast gives it to the head's matmul
            x = x.to(cdtype)
        loss = linear_cross_entropy_op(x, head.weight, target, head.bias, ignore_index=a.get("ignore_index", -100),
                                       reduction=a.get("reduction", "mean"),
                                       label_smoothing=a.get("label_smoothing", 0.0), scale=scale, softcap=softcap,
                                       cdtype=cdtype)
        if self.ac is None and loss.dtype != z.dtype:
            loss = loss.to(z.dtype)
        self.consumed = True
        return loss


class _Attach(torch.autograd.Function):
    """``real`` as a :class:`LazyLogits` of the same data, on its autograd graph (identity backward)."""

    @staticmethod
    def forward(ctx, real):
        return torch.Tensor._make_subclass(LazyLogits, real)

    @staticmethod
    def backward(ctx, grad):
        return grad


class LazyLogits(torch.Tensor):
    """The logits of one compiled call, or an upcast, view, scaling or soft-capping of them (module doc)."""

    @staticmethod
    def attach(window: CompiledWindow, real: torch.Tensor, ops: tuple) -> "LazyLogits":
        z = _Attach.apply(real)
        z._window, z._ops = window, ops
        return z

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lazies = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, LazyLogits)]
        name = name_of(func)
        if lazies and func is F.cross_entropy:
            out = lazies[0]._window.cross_entropy(args, kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not lazies or name in _META or name == "untyped_storage":
            return out
        win = lazies[0]._window
        if len(lazies) == 1 and not win.unfused and isinstance(out, torch.Tensor):
            kind = _deferred(win, lazies[0], name, args, kwargs)
            if kind is not None:
                return LazyLogits.attach(win, out, lazies[0]._ops + (kind,))
        win.unfused = True  # the logits are used otherwise: this call's loss is the model's own
        return out


def _deferred(win: CompiledWindow, z: LazyLogits, name: str, args, kwargs):
    """What ``func(z, ...)`` does to the logits when the fused loss can take it (None otherwise)."""
    v = win.head.out_features
    first = args[0] is z if args else False
    if name in _SHAPE and first:
        shape = _shape_of(z, name, args[1:], kwargs)
        return ("shape",) if shape is not None and len(shape) >= 1 and shape[-1] == v else None
    if name in _CAST and first:
        return ("cast",) if cast_dtype(name, z, args[1:], kwargs) is not None else None
    if name in _MUL and len(args) == 2 and not kwargs:
        other = args[1] if first else args[0]
        return ("mul", other) if _scalar(other) else None
    if name in _DIV and len(args) == 2 and first and not kwargs and _scalar(args[1]) and args[1] != 0:
        return ("div", args[1])
    if name in _TANH and len(args) == 1 and first and not kwargs:
        return ("tanh",)
    return None


def _shape_of(z, name, rest, kwargs):
    """The shape of ``z.view/reshape/flatten(...)``, from the arguments (no tensor made)."""
    shape, n = tuple(z.shape), z.numel()
    if name == "contiguous":
        return shape if not rest and not kwargs else None
    if name == "flatten":
        start = rest[0] if rest else kwargs.get("start_dim", 0)
        end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
        d = len(shape)
        start, end = start % d if d else 0, end % d if d else 0
        return shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]
    if kwargs or not rest:
        return None
    spec = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else tuple(rest)
    if not all(isinstance(s, int) for s in spec):
        return None
    known = math.prod([s for s in spec if s != -1])
    if spec.count(-1) > 1 or known == 0:
        return None
    out = tuple(n // known if s == -1 else s for s in spec)
    return out if math.prod(out) == n else None


def _logit_form(ops) -> tuple[float, float | None] | None:
    """(scale, softcap) when the recorded operations are z ↦ [c·tanh](s·z) with upcasts and views
    anywhere; None otherwise."""
    num, den, post, tanh = 1.0, 1.0, 1.0, False
    for kind in ops:
        if kind[0] in ("shape", "cast"):
            continue
        if kind[0] == "tanh":
            if tanh:
                return None
            tanh = True
        elif kind[0] == "mul":
            if tanh:
                post *= kind[1]
            else:
                num *= kind[1]
        elif kind[0] == "div":
            if tanh:
                post /= kind[1]
            else:
                den *= kind[1]
    if not tanh:
        return num / den, None
    if not post > 0:
        return None
    return (num * post) / den if (num * post) != den else 1.0, post
