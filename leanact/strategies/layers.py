"""Finding the repeated blocks (layers) of a model."""
from __future__ import annotations

from torch import nn

__all__ = ["find_layers"]


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``: the children of its longest ``nn.ModuleList`` whose
    entries are all of one class (Hugging Face's ``encoder.layer`` / ``h`` / ``layers``; blocks of
    one class may differ in size). Ties go to the list met first (outermost). Returns
    ``[(qualified name, block), ...]`` in forward order."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        if best is None or len(mod) > len(best[1]):
            best = (name, mod)
    if best is None:
        raise ValueError(
            f"no repeated layers found in {type(model).__name__}: leanact looks for an nn.ModuleList of "
            "blocks of one class (as Hugging Face models have). Fix: put the blocks in an nn.ModuleList, or "
            "name them explicitly: leanact.strategies.Plan(['blocks.0', 'blocks.1'], ['full', 'lean']).")
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{i}", m) for i, m in enumerate(best[1])]
