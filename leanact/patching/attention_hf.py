"""leanact's attention as a Hugging Face ``AttentionInterface`` function (transformers >= 5).

``register()`` adds the name ``"leanact"`` to transformers' attention registry (the function
below) and to its mask registry (transformers' own ``sdpa_mask``: a bool mask, True = attend, or
None when it can be skipped -- the format :func:`leanact.functional.attention` takes, as SDPA does).
A model then selects it with ``model.set_attn_implementation("leanact")``; nothing in the model's
code is replaced.

The function mirrors the signature and semantics of transformers'
``integrations.sdpa_attention.sdpa_attention_forward`` (returns ``(b, s, H, d)`` output and no
weights), with three exceptions, decided per call:

* ``output_attentions=True``: the model's own ``eager_attention_forward`` (the probabilities are
  materialised and returned), with the bool mask turned into the additive one eager expects.
* no autograd (``torch.no_grad``, inference) and no dropout: the implementation the model had
  before patching (``"eager"`` or ``"sdpa"``), so that inference outputs are bit-identical to the
  unpatched model's. With dropout (training under ``no_grad``, e.g. the first forward of a
  reentrant gradient checkpoint) leanact's core runs, so the recompute draws the same mask.
* features leanact's core does not cover (``softcap``, attention sinks, a paged cache,
  ``position_bias``): transformers' SDPA function, recorded once as a warning.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..ops.attention import attention as _lean_attention

__all__ = ["NAME", "register", "leanact_attention_forward", "set_config_state", "config_state"]

NAME = "leanact"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window_pattern")


@dataclass
class _ConfigState:
    original: str  # the attention implementation before patching
    mode: str  # "recompute" or "tempo"


# id(config) -> (weakref to config, state). Configs are not hashable; a weakref keeps ids honest.
_STATES: dict[int, tuple[weakref.ref, _ConfigState]] = {}


def set_config_state(config, state: _ConfigState | None) -> None:
    key = id(config)
    if state is None:
        _STATES.pop(key, None)
        return
    _STATES[key] = (weakref.ref(config, lambda _r, k=key: _STATES.pop(k, None)), state)


def config_state(config) -> _ConfigState | None:
    entry = _STATES.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    return entry[1]


def register() -> None:
    """Register ``"leanact"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, leanact_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def _eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """The model file's own eager attention (materialises the probabilities)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    mask = _additive(attention_mask, query.dtype)
    if fn is None:
        fn = _generic_eager
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _generic_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[..., : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


_warned: set[str] = set()


def leanact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``AttentionInterface`` function: q, k, v (b, H, s, d) -> ((b, s, H, d) output, weights or None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = config_state(getattr(module, "config", None))
    original = state.original if state is not None else "sdpa"
    mode = state.mode if state is not None else "recompute"
    if kwargs.get("output_attentions", False):
        return _eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # Without dropout, no-autograd calls use the original implementation (bit-identical inference).
    # With dropout they stay on leanact's core: the first forward of a reentrant checkpoint runs
    # without autograd and the recompute with it, and both must draw the same dropout mask.
    if not needs_grad and not dropout:
        if original == "eager":
            return _eager(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    unsupported = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if kwargs.get("cache") is not None:
        unsupported.append("cache")
    if unsupported:
        tag = ",".join(unsupported)
        if tag not in _warned:
            _warned.add(tag)
            warnings.warn(f"leanact attention: {tag} not supported, using transformers' sdpa for these calls",
                          stacklevel=2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)

    q_len, kv_len = query.shape[2], key.shape[2]
    # Same causal rule as transformers' sdpa function (SDPA's and leanact's is_causal are top-left).
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = _lean_attention(query, key, value, attention_mask, dropout_p=float(dropout), is_causal=causal,
                          scale=scaling, mode=mode, training=True,  # like SDPA: the caller's dropout decides
                          enable_gqa=gqa)
    # out is a (b, H, s, d) view of a (b, s, H, d) buffer: this transpose is free and contiguous.
    return out.transpose(1, 2).contiguous(), None
