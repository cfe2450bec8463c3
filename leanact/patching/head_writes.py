"""Whether a torch function may write into the fused head's logits (eager and compiled heads)."""
from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["writes", "name_of", "cast_dtype", "fusable_call"]

_ASSIGN = frozenset({"__set__", "__setitem__", "__delitem__"})  # ``t.data = v``, ``t[i] = v``, ``del t[i]``


def name_of(func) -> str:
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return getattr(func, "__name__", repr(func))


def writes(func, args, kwargs) -> bool:
    """Whether ``func`` may write into a tensor argument; whatever is not known to write nothing counts
    as writing. Known: an aten operator of its name (``mul`` for ``__mul__``) none of whose overloads
    writes a positional argument, called without ``out=`` (and ``inplace=False`` where it has one). So
    ``div_``, ``index_put_``, ``copy_``, ``+=``, ``z[...] = v``, ``z.data = v``, ``out=``,
    ``F.relu(z, inplace=True)`` and any name aten lacks (``register_hook``, ``numpy``) write."""
    if kwargs.get("out") is not None or getattr(func, "__name__", "") in _ASSIGN:
        return True
    i = _inplace_position(func)
    flag = kwargs.get("inplace", args[i] if i is not None and i < len(args) else False)
    return (isinstance(flag, (bool, int)) and bool(flag)) or not _pure(name_of(func))


@functools.lru_cache(maxsize=1024)
def _inplace_position(func) -> int | None:
    """The position of a Python function's ``inplace`` parameter (``F.relu``, ``F.dropout``), if any."""
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


@functools.lru_cache(maxsize=None)
def _pure(name: str) -> bool:
    """Whether aten has an operator ``name`` (``rsub`` for ``__rsub__``) none of whose overloads writes a
    positional argument (the ``out=`` overloads' outputs are keyword-only: seen in the call)."""
    for n in (name, name.strip("_")) if name.startswith("__") else (name,):
        try:
            packet = getattr(torch.ops.aten, n)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):  # (the namespace's own attributes: ``name``)
            continue
        return not any(a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only
                       for o in packet.overloads() for a in getattr(packet, o)._schema.arguments)
    return False


def cast_dtype(name: str, t: torch.Tensor, args, kwargs) -> torch.dtype | None:
    """The dtype of ``t.float()``, ``t.double()`` or ``t.to(...)`` (``name``, its arguments after
    ``t``) when the cast keeps the logits' precision or raises it on their device; None otherwise."""
    if name == "float" and not args and not kwargs:
        new = torch.float32
    elif name == "double" and not args and not kwargs:
        new = torch.float64
    elif name == "to":
        rest = dict(kwargs)
        rest.pop("non_blocking", None)
        if rest.pop("copy", False):
            return None
        new, dev = rest.pop("dtype", None), rest.pop("device", None)
        for p in args:
            if isinstance(p, torch.dtype) and new is None:
                new = p
            elif isinstance(p, (str, torch.device)) and dev is None:
                dev = p
            else:
                return None
        if rest or new is None or (dev is not None and torch.device(dev) != t.device):
            return None
    else:
        return None
    if not new.is_floating_point or torch.finfo(new).bits < torch.finfo(t.dtype).bits:
        return None
    return new


def fusable_call(a: dict, z: torch.Tensor, target, tokens: int) -> bool:
    """Whether ``F.cross_entropy``'s bound arguments ``a`` on logits ``z`` of ``tokens`` rows are a call
    the fused loss computes: 2-D logits, 1-D class-index targets of the same rows, no class weights,
    none of the deprecated ``size_average`` / ``reduce``."""
    return (isinstance(target, torch.Tensor) and not target.dtype.is_floating_point and target.dtype != torch.bool
            and a.get("weight") is None and a.get("size_average") is None and a.get("reduce") is None
            and z.dim() == 2 and target.dim() == 1 and target.shape[0] == z.shape[0] == tokens)
