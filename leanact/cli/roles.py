"""The role of a tensor kept for backward (attention, linear inputs, GELU, norms, dropout, other),
from the module that kept it and the autograd op that holds it: the groups of ``--plot``."""
from __future__ import annotations

__all__ = ["ROLES", "COLOURS", "role_of"]

# In plotting order (bottom of the stacked bar first); each role has the same colour in every bar.
ROLES = ("attention", "linear inputs", "GELU / activation", "norms", "dropout", "other")
COLOURS = {"attention": "#4c72b0", "linear inputs": "#dd8452", "GELU / activation": "#55a868",
           "norms": "#c44e52", "dropout": "#8172b3", "other": "#937860"}

_LINEAR_OPS = {"Addmm", "Mm", "Linear", "AddmmActivation", "Matmul", "UnsafeView", "Baddbmm"}
_ATTENTION_OPS = {"Bmm", "Softmax", "SafeSoftmax"}
_ACTIVATION_OPS = {"Gelu", "Silu", "Relu", "Tanh", "Sigmoid", "NewGelu", "GeluTanh", "Swiglu"}


def _parts(module: str) -> list[str]:
    return [p.lower() for p in module.replace("/", ".").split(".") if p]


def role_of(module: str, op: str) -> str:
    """The role of one kept tensor: by its autograd op first, then by the innermost module name."""
    low = op.lower()
    if "dropout" in low:
        return "dropout"
    if "norm" in low:
        return "norms"
    if "attention" in low or op in _ATTENTION_OPS or low.startswith("scaleddotproduct"):
        return "attention"
    if op in _ACTIVATION_OPS or "gelu" in low or "silu" in low or "swiglu" in low:
        return "GELU / activation"
    if op in _LINEAR_OPS:
        return "linear inputs"
    # Elementwise ops (Mul, Pow, Rsqrt, ...): the module that ran them says what they are part of.
    for part in reversed(_parts(module)):
        if "drop" in part:
            return "dropout"
        if "norm" in part or part.startswith("ln") or part.endswith("_ln"):
            return "norms"
        if part.startswith("act") or "mlp" in part or "intermediate" in part:
            return "GELU / activation"
        if "attn" in part or "attention" in part:
            return "attention"
    return "other"
