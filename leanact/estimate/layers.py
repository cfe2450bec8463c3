"""Grouping per-module byte counts into the model's repeated blocks (layers)."""
from __future__ import annotations

from torch import nn

__all__ = ["layer_names", "group_by_layer"]


def layer_names(model: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks: the children of the longest ``nn.ModuleList`` whose
    entries share one class ([] when the model has none)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [f"{prefix}{i}" for i in range(len(best[1]))]


def group_by_layer(by_module: dict[str, int], layers: list[str], *, exact_only: bool = False) -> dict[str, int]:
    """Sum ``by_module`` over each layer's subtree (names ``layer``, ``layer.*`` and ``layer/*``,
    the meter's label for unregistered submodules). ``exact_only``: only the entry named ``layer``
    (for counts that already include the subtree)."""
    out = {name: 0 for name in layers}
    for mod, n in by_module.items():
        for name in layers:
            if mod == name or (not exact_only and (mod.startswith(name + ".") or mod.startswith(name + "/"))):
                out[name] += n
                break
    return out
