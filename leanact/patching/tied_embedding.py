"""A tied model's input embedding whose backward takes the fused head's weight gradient.

Where the output embedding's weight *is* the input embedding's (``tie_word_embeddings``: Llama 3.2
1B/3B, Gemma, GPT-2, BERT's MLM head, T5), the input embedding is replaced by a lean twin (the same
module state, Parameters and buffers; :func:`~leanact.patching.modules.reclass`) whose forward runs
the class's own forward (a scaled embedding's scale included) with the lookup of that weight sent
to :func:`leanact.ops.embedding.tied_embedding`. A leanact head (the fused loss, TRL's head under
:mod:`.trl_head`) then hands its dW to the embedding's node, which adds the token rows into it: the
weight's gradient is made once, the same values bit for bit, without the second dense vocabulary ×
width tensor at the end of the backward (Llama-3.2-1B in bf16: 501 MiB, 1,002 MiB with the
out-of-place sum a ``TorchDispatchMode`` makes). Calls without grad, under ``torch.compile`` or
``torch.func`` transforms, and lookups with ``max_norm``, ``sparse`` or ``scale_grad_by_freq``, run
``F.embedding`` as it is. An embedding with hooks registered on it is left (named in the summary).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..ops.embedding import tied_embedding
from ..ops.transforms import functorch_active
from .adapter import ModelStep, PatchRun
from .modules import hooks_reason, reclass

__all__ = ["TiedEmbeddingMixin", "tied_input_embedding", "STEP"]

_EMBEDDING = torch.nn.functional.embedding
_SIGNATURE = inspect.signature(_EMBEDDING)
LABEL = "leanact.ops.embedding.tied_embedding (takes the fused head's weight gradient)"


class _Lookup(TorchFunctionMode):
    """Sends ``F.embedding`` of one weight (and nothing else) to :func:`tied_embedding`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _EMBEDDING:
            a = _SIGNATURE.bind(*args, **kwargs).arguments
            if (a.get("weight") is self.weight and a.get("max_norm") is None and not a.get("sparse", False)
                    and not a.get("scale_grad_by_freq", False) and isinstance(a.get("input"), torch.Tensor)
                    and not a["input"].is_floating_point()):
                return tied_embedding(a["input"], self.weight, a.get("padding_idx"))
        return func(*args, **kwargs)


class TiedEmbeddingMixin:
    """The lean twin's forward: the class's own, its lookup of ``self.weight`` through
    :func:`tied_embedding` where a backward will run (module doc)."""

    def forward(self, *args, **kwargs):
        if (not torch.is_grad_enabled() or not self.weight.requires_grad or torch.compiler.is_compiling()
                or functorch_active() or self.max_norm is not None or self.sparse or self.scale_grad_by_freq):
            return super().forward(*args, **kwargs)
        with _Lookup(self.weight):  # (one frame: left even on KeyboardInterrupt)
            return super().forward(*args, **kwargs)


def tied_input_embedding(model: nn.Module) -> tuple[nn.Embedding | None, str | None]:
    """``model``'s input embedding if its output embedding's weight is the same Parameter (else None),
    and why it is left (None: it is not)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return None, None
    try:
        emb, head = get_in(), get_out()
    except (NotImplementedError, AttributeError):
        return None, None
    if not isinstance(emb, nn.Embedding) or head is None or getattr(head, "weight", None) is not emb.weight:
        return None, None
    if isinstance(emb, TiedEmbeddingMixin):
        return None, None
    reason = hooks_reason(emb)
    if reason is None and (emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq):
        reason = "max_norm, sparse or scale_grad_by_freq set: torch's lookup, its own gradient"
    return emb, reason


def _install(model: nn.Module, run: PatchRun) -> None:
    emb, reason = tied_input_embedding(model)
    if emb is None:
        return
    places = [(qual, parent, name) for qual, parent in model.named_modules(remove_duplicate=False)
              for name, child in parent._modules.items() if child is emb]
    if reason is not None:
        run.summary.left.append((f"{places[0][0]}.{places[0][2]}".lstrip(".") if places else "input embedding",
                                 type(emb).__name__, reason))
        return
    new = reclass(emb, TiedEmbeddingMixin)
    seen = set()
    for qual, parent, name in places:
        if (id(parent), name) not in seen:
            seen.add((id(parent), name))
            run.swap(parent, name, new, LABEL, f"{qual}.{name}".lstrip("."))


STEP = ModelStep("tied_embedding", _install)
