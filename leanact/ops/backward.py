"""``once_differentiable`` for leanact's autograd Functions, without its cost on the common path, and
with no silent constant under ``create_graph=True``.

torch's decorator enters ``torch.no_grad()`` around every backward and, where an incoming gradient
requires grad, returns results whose further differentiation raises. The autograd engine already
runs a backward with grad mode off unless ``create_graph=True``; there the context manager only
costs host time (a few microseconds per call, per op and layer): this wrapper then calls the
backward directly. Under ``create_graph=True`` torch's test misses results that depend on the op's
*inputs* (γ, a weight, x: what the backward reads from its saved tensors) while the incoming
gradient is a constant (the loss's own, ones): a gradient penalty built on them would silently be a
constant. Here the results raise when differentiated whenever an incoming gradient or an input of
the op requires grad, with an error that names leanact and the way out. The raising node also
takes the op's saved tensors that require grad (its inputs, or its output: paths to them): a node
fed only the detached results lies on no path to the parameters, so ``torch.autograd.grad(loss +
penalty, params)`` would skip it and silently drop the penalty's terms (it raises only under a
plain ``backward()``, which runs every node).
"""
from __future__ import annotations

import functools

import torch
from torch._C import _functions

__all__ = ["once_differentiable", "DOUBLE_BACKWARD_ERROR"]

DOUBLE_BACKWARD_ERROR = (
    "trying to differentiate twice a function that was marked with @once_differentiable: leanact's {name} "
    "has no double backward (create_graph=True, a gradient penalty, a Hessian-vector product). Compute "
    "higher-order gradients on the unpatched model: leanact.unpatch(model), or leanact.patch(model, "
    "fused_loss=False) where only the loss head is concerned")


def _raising(outputs, name: str, error: str = DOUBLE_BACKWARD_ERROR, anchors=()):
    """``outputs`` as results whose differentiation raises ``error`` (:data:`DOUBLE_BACKWARD_ERROR`:
    an op may name its own way out), from a node that also takes ``anchors`` (tensors on the paths
    to the op's inputs: the node is then on every path a second differentiation takes to them)."""
    single = not isinstance(outputs, tuple)
    outs = (outputs,) if single else outputs
    anchors = tuple(a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad)
    err = _functions.DelayedError(error.format(name=name).encode(), len(outs) + len(anchors))

    def leaf(t):
        if t is None:
            return None
        t = t.detach()
        t.requires_grad_(True)
        return t

    res = err(*[leaf(t) for t in outs], *anchors)
    res = res if isinstance(res, tuple) else (res,)
    res = tuple(None if o is None else r for o, r in zip(outs, res))
    return res[0] if single else res


def once_differentiable(backward):
    """torch's ``once_differentiable``, skipped where it would change nothing (grad mode off), and
    raising on a second differentiation wherever the results depend on something requiring grad."""
    name = backward.__qualname__.rsplit(".backward", 1)[0]

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads) or any(
                getattr(ctx, "needs_input_grad", ())):
            return _raising(outputs, name, anchors=_saved(ctx))
        return outputs

    return wrapper


def _saved(ctx) -> tuple:
    """The op's saved tensors (those requiring grad lead to its inputs); none where it saved none."""
    try:
        return tuple(ctx.saved_tensors)
    except (RuntimeError, AttributeError):
        return ()
