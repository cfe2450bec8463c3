"""Hugging Face ``dense → dropout → LayerNorm(· + residual)`` sub-layer ends (BERT's ``BertSelfOutput``,
``BertOutput`` and their copies in RoBERTa, ELECTRA, XLM-R, ... ) -> one fused op after ``dense``.

HF's forward is ``LayerNorm(dropout(dense(x)) + residual)``. Patched, ``dense`` runs as a module
(its hooks fire; leanact's weight recast applies) and the rest is
:func:`leanact.ops.norms.dropout_add_norm.dropout_add_layer_norm`: one op (on CUDA one kernel each way)
keeping y, rstd and the dropout's seed, what leanact's dropout and LayerNorm keep when run one after
the other, without writing the dropout output and the sum. Its results are those of the two lean
modules (the same mask, the same roundings; the norm's statistics to float32 rounding on CUDA).

The ``dropout`` and ``LayerNorm`` children become leanact's (:class:`leanact.nn.Dropout`,
:class:`leanact.nn.LayerNorm`, the same Parameters), so wherever the fused op does not apply (no
autograd, compiling, ``torch.func`` transforms, a child with hooks or an instance ``forward``,
other arguments) HF's forward runs them as a patched model would. Recognised from structure and
forward, whatever the class name: a module defined in ``transformers.models.*`` with children
``dense``, ``dropout`` (``nn.Dropout``) and ``LayerNorm`` (``nn.LayerNorm``), no parameters of its
own, no hooks, and the forward above (two arguments).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .. import nn as lnn
from ..ops.norms.dropout_add_norm import dropout_add_layer_norm
from ..ops.transforms import functorch_active
from .modules import hook_kinds, hooks_reason, reclass, unchanged
from .source import forward_body
from .adapter import ModuleAdapter

__all__ = ["is_hf_residual_norm", "hf_residual_norm_replacement", "PATCHED_CHILDREN", "ADAPTER"]

#: instance attribute of a replacement: {name: child} of the children :func:`leanact.patch` made for
#: it (``unpatch`` gives the original module its own back; children set since then stay)
PATCHED_CHILDREN = "_leanact_patched_children"
_CHILDREN = ("dense", "dropout", "LayerNorm")
_checked: dict[type, str | None] = {}


def is_hf_residual_norm(m: nn.Module) -> bool:
    """A transformers module with children ``dense``, ``dropout`` and ``LayerNorm`` (nothing else)."""
    return (type(m).__module__.startswith("transformers.models.") and set(m._modules) == set(_CHILDREN)
            and isinstance(m._modules["dropout"], nn.Dropout) and isinstance(m._modules["LayerNorm"], nn.LayerNorm))


def _forward_reason(t: type) -> str | None:
    """None if ``t.forward(x, r)`` is ``LayerNorm(dropout(dense(x)) + r)`` in HF's three statements."""
    if t not in _checked:
        body = forward_body(t.forward)
        if body is None or len(body[0]) != 2:
            _checked[t] = ("forward source unavailable or not two arguments: cannot check it is "
                           "LayerNorm(dropout(dense(x)) + r)")
        else:
            x, r = (re.escape(a) for a in body[0])
            steps = (rf"(\w+)=self\.dense\({x}\);(\w+)=self\.dropout\(\1\);(\w+)=self\.LayerNorm\(\2\+{r}\);"
                     rf"return\3")
            _checked[t] = None if re.fullmatch(steps, body[1]) else "forward is not LayerNorm(dropout(dense(x)) + r)"
    return _checked[t]


class _LeanHFResidualNorm:
    """Mixin placed before the HF class: with autograd, ``dense`` then the fused dropout + add +
    LayerNorm (module doc); otherwise HF's own forward (on the lean children)."""

    _leanact_lean = True

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hf_forward = type(self).__mro__[2].forward  # the original HF class (Lean subclass -> HF class)
        mods = self._modules
        drop, norm = mods.get("dropout"), mods.get("LayerNorm")
        if (len(args) != 2 or kwargs or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or functorch_active() or not unchanged(drop, lnn.Dropout) or not unchanged(norm, lnn.LayerNorm)
                or drop.inplace or norm.from_output is not None or not isinstance(mods.get("dense"), nn.Module)):
            return hf_forward(self, *args, **kwargs)
        x, residual = args
        if not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor):
            return hf_forward(self, *args, **kwargs)
        h = mods["dense"](x)
        return dropout_add_layer_norm(h, residual, norm.normalized_shape, norm.weight, norm.bias, norm.eps, drop.p,
                                      drop.training, max_ratio=norm.max_ratio)


def _lean_child(m: nn.Module) -> nn.Module:
    """The leanact module for an exact ``nn.Dropout`` / ``nn.LayerNorm`` (the same Parameters)."""
    if type(m) is nn.Dropout:
        new = lnn.Dropout(m.p, m.inplace)
    else:
        new = lnn.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine,
                            bias=m.bias is not None, device="meta")
        new.weight, new.bias = m.weight, m.bias
    new.train(m.training)
    return new


def hf_residual_norm_replacement(m: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(new module sharing m's ``dense`` and Parameters, with lean ``dropout`` / ``LayerNorm``
    children, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanHFResidualNorm):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    if m._parameters:
        return None, f"{t.__name__}: parameters of its own (not dense, dropout, LayerNorm)"
    for k, want in (("dropout", nn.Dropout), ("LayerNorm", nn.LayerNorm)):
        c = m._modules[k]
        if type(c) is not want:
            return None, f"{k} is {type(c).__name__}, not torch.nn.{want.__name__} (a subclass may override forward)"
        if (kinds := hook_kinds(c)):
            return None, f"{k} has hooks registered on it ({', '.join(kinds)})"
    if (reason := _forward_reason(t)) is not None:
        return None, reason
    new = reclass(m, _LeanHFResidualNorm)
    for k in ("dropout", "LayerNorm"):
        new._modules[k] = _lean_child(m._modules[k])
    new.__dict__[PATCHED_CHILDREN] = {k: new._modules[k] for k in ("dropout", "LayerNorm")}
    return new, None


ADAPTER = ModuleAdapter("hf_residual_norm", is_hf_residual_norm, hf_residual_norm_replacement,
                        "BERT-style dense -> dropout -> add -> LayerNorm output blocks")
