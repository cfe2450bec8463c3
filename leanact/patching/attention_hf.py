"""leanact's attention as a Hugging Face ``AttentionInterface`` function (transformers >= 5).

``register()`` adds the name ``"leanact"`` to transformers' attention registry (the function
below) and to its mask registry (transformers' own ``sdpa_mask``: a bool mask, True = attend, or
None when it can be skipped -- the format :func:`leanact.functional.attention` takes, as SDPA does).
A model then selects it with ``model.set_attn_implementation("leanact")``; nothing in the model's
code is replaced.

The function mirrors the signature and semantics of transformers'
``integrations.sdpa_attention.sdpa_attention_forward`` (returns ``(b, s, H, d)`` output and no
weights), with three exceptions, decided per call:

* ``output_attentions=True``: the original implementation, as the unpatched model would run it:
  the model's own ``eager_attention_forward`` (the probabilities are materialised and returned,
  the bool mask turned into the additive one eager expects and the causal triangle made explicit
  where the mask function left it to ``is_causal``), or transformers' SDPA function (which
  returns no probabilities).
* no autograd (``torch.no_grad``, inference) and no dropout: the implementation the model had
  before patching (``"eager"`` or ``"sdpa"``), so that inference outputs are bit-identical to the
  unpatched model's. With dropout (training under ``no_grad``, e.g. the first forward of a
  reentrant gradient checkpoint) leanact's core runs, so the recompute draws the same mask.
* T5's ``position_bias`` (learned, additive) goes to the core as an additive mask, with the
  padding mask and the causal triangle added to it; it gets its gradient from the core.
* Gemma 2's logit ``softcap`` and GPT-OSS's attention sinks (``s_aux``) go to the core
  (:func:`leanact.ops.attention.attention`'s ``softcap`` and ``sinks``); sliding windows come as
  the mask transformers builds for them.
* features leanact's core does not cover (a paged cache): the implementation the model had before
  patching (the model's eager function or transformers' SDPA function), recorded in the state
  (shown by ``leanact.summary``) and warned about once.

Semantics follow the original implementation: a query row whose keys are all masked (left
padding under a causal mask) is 0 under SDPA and, under the model's eager function (additive
mask of dtype-min values), the uniform average of the values; leanact reproduces whichever the
model had (without dropout on such rows).

The per-model state (original implementation, mode) is kept on each module that has the patched
config as ``module.config`` (attribute ``_leanact_attention``), so ``copy.deepcopy`` and pickling
carry it, and unpickling it registers ``"leanact"`` with transformers (``torch.load`` in a fresh
process works).

``config.output_attentions = True`` (and the config's ``validate()``, run by ``save_pretrained``):
transformers accepts it for ``"eager"`` only, by name (its setter and ``validate_output_attentions``;
there is no registry flag for other implementations). :func:`accept_output_attentions` gives a patched
config a subclass of its class (same name) whose setter and ``validate`` put that question to the
original implementation instead: accepted where the unpatched model accepts it (eager), the same error
where it raises (sdpa). Equality, pickling and copies behave as for the original class;
:func:`release_config` (``unpatch``) gives the config its class back.
"""
from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..ops.attention import attention as _lean_attention
from ..ops.attention.masked_rows import EagerMaskedRows

__all__ = ["NAME", "ATTR", "EXCHANGE", "local_masks_off", "register", "leanact_attention_forward", "set_config_state",
           "config_state", "module_state", "accept_output_attentions", "release_config"]

NAME = "leanact"
_UNSUPPORTED_KWARGS = ("sliding_window_pattern",)
_SINK_KWARGS = ("s_aux", "sinks")  # GPT-OSS passes its (H,) sink logits as s_aux


ATTR = "_leanact_attention"


@dataclass
class _ConfigState:
    original: str  # the attention implementation before patching
    mode: str  # "recompute" or "tempo"
    fallbacks: set = field(default_factory=set)  # features seen at run time that sent calls to `original`

    def __setstate__(self, state):  # unpickling (torch.load, deepcopy): "leanact" must be known again
        self.__dict__.update(state)
        self.__dict__.setdefault("fallbacks", set())
        try:
            register()
        except ImportError:  # pragma: no cover - transformers missing where the model is loaded
            pass


# id(config) -> (weakref to config, state), for modules without their own state attribute.
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


def module_state(module) -> _ConfigState | None:
    """The state of the patched model ``module`` belongs to: its own attribute, else its config's."""
    state = getattr(module, "__dict__", {}).get(ATTR)
    return state if state is not None else config_state(getattr(module, "config", None))


def register() -> None:
    """Register ``"leanact"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, leanact_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)


# ---- context parallelism (leanact.parallel.context): the exchange protocol, the model's own masks off ----
#: The keyword argument that carries a context-parallel exchange from the model's call down to each
#: attention call (transformers passes a model's extra keyword arguments to its attention functions,
#: and torch.utils.checkpoint keeps them for the recompute).
EXCHANGE = "leanact_context_parallel"
_CORE = "_leanact_core"  # (internal) leanact's core for this call, whatever the grad mode
_SEGMENTS = "_leanact_segments"  # (internal) the exchange's (segment ids, window, dead rows) for the core
_LOCAL_MASKS_OFF = [0]  # > 0 while a context-parallel forward runs (a list: read by Dynamo as a guarded global)


def _mask(*args, **kwargs):
    """transformers' ``sdpa_mask``; None while a context-parallel forward runs: the model would build
    its mask for the local shard only, which the exchange replaces with the whole sequence's."""
    if _LOCAL_MASKS_OFF[0]:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def local_masks_off(on: bool) -> None:
    """Enter (True) or leave (False) a context-parallel forward (nested calls counted)."""
    _LOCAL_MASKS_OFF[0] = max(0, _LOCAL_MASKS_OFF[0] + (1 if on else -1))


def _exchanged(exchange, module, query, key, value, dropout, scaling, is_causal, kwargs):
    """Context parallelism: ``exchange`` (see :mod:`leanact.parallel.context`) turns q, k, v of the local
    sequence shard and every head into the whole sequence of this rank's heads (all-to-all), the
    attention runs on that with the whole sequence's mask, and the output goes back (all-to-all)."""
    if _weights_requested(kwargs):
        raise ValueError("leanact.parallel.context_parallel: output_attentions is not supported "
                         "(each rank holds a share of the heads); call the model without it")
    causal = _causal(module, is_causal, exchange.length)
    query, key, value = exchange.gather(query, key, value)
    window = kwargs.get("sliding_window")
    segments, window = exchange.mask(causal, window, query.device)
    dead = exchange.dead_rows(causal, window, query.device)
    # leanact's core for every call, with or without autograd: after repeating key/value heads the
    # group ratio is not the module's, which the model's own functions would use (num_key_value_groups)
    out, _ = leanact_attention_forward(module, query, key, value, None, dropout, scaling, is_causal, **kwargs,
                                       **{_CORE: True, _SEGMENTS: (segments, window, dead)})
    return exchange.scatter(out), None


# ---- configs that accept output_attentions where the original implementation does (module doc) ----
_ACCEPTING: dict[tuple[type, str], type] = {}  # (config class, original implementation) -> subclass


def _plain(config, original: str | None = None):
    """A shallow twin of ``config`` of its original class (same attribute values); with ``original``,
    showing that implementation where ``config`` has ``"leanact"``. ``config`` itself is not changed."""
    twin = object.__new__(type(config).__dict__["_leanact_base"])
    twin.__dict__.update(config.__dict__)
    key = next((k for k in ("_attn_implementation_internal", "_attn_implementation") if k in twin.__dict__), None)
    if original is not None and twin.__dict__.get(key) == NAME:
        twin.__dict__[key] = original
    return twin, key


def _set_output_attentions(self, value) -> None:
    twin, key = _plain(self, type(self)._leanact_original)
    inspect.getattr_static(type(twin), "output_attentions").fset(twin, value)  # transformers' own rule
    self.__dict__.update({k: v for k, v in twin.__dict__.items() if k != key})


def _validate(self) -> None:
    type(self)._leanact_base.validate(_plain(self, type(self)._leanact_original)[0])


def _eq(self, other):
    return _plain(self)[0] == (_plain(other)[0] if "_leanact_base" in type(other).__dict__ else other)


def _reduce_ex(self, protocol):
    cls = type(self)
    return _accepting_instance, (cls._leanact_base, cls._leanact_original), self.__dict__


def _accepting_instance(base: type, original: str):
    """An empty instance of the accepting subclass (unpickling, copies); the state is set after."""
    return object.__new__(_accepting_class(base, original))


def _accepting_class(base: type, original: str) -> type:
    cls = _ACCEPTING.get((base, original))
    if cls is None:
        # __init__/__eq__ given here: transformers turns every config subclass into a dataclass, which
        # would otherwise generate them (its __eq__ compares same-class instances only)
        ns = {"__module__": __name__, "__qualname__": base.__name__, "__init__": base.__init__, "__eq__": _eq,
              "__hash__": base.__hash__, "__reduce_ex__": _reduce_ex, "_leanact_base": base,
              "_leanact_original": original, "output_attentions": property(
                  inspect.getattr_static(base, "output_attentions").fget, _set_output_attentions)}
        if hasattr(base, "validate"):
            ns["validate"] = _validate
        cls = _ACCEPTING[(base, original)] = type(base.__name__, (base,), ns)
    return cls


def accept_output_attentions(config, original: str) -> None:
    """Let ``config`` (set to ``"leanact"``) accept ``output_attentions`` as ``original`` would (module doc).
    Nothing to do where ``output_attentions`` is no property with a setter (other config layouts)."""
    base = type(config).__dict__.get("_leanact_base", type(config))
    prop = inspect.getattr_static(base, "output_attentions", None)
    if isinstance(prop, property) and prop.fset is not None:
        config.__class__ = _accepting_class(base, original)


def release_config(config) -> None:
    """Undo :func:`accept_output_attentions`: the config's own class again."""
    base = type(config).__dict__.get("_leanact_base")
    if base is not None:
        config.__class__ = base


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def _causal(module, is_causal, q_len: int) -> bool:
    """Transformers' SDPA rule: causal unless the call or the module says otherwise, for q_len > 1."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(q_len > 1 and causal)


def _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal=None, **kwargs):
    """The model file's own eager attention (materialises the probabilities).

    The mask function registered for "leanact" (transformers' ``sdpa_mask``) returns None where
    ``is_causal`` can stand in for the mask; eager functions take no ``is_causal``, so the causal
    triangle (top-left, as SDPA's ``is_causal``) is made explicit here."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if attention_mask is None and _causal(module, is_causal, query.shape[2]):
        attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        attention_mask = attention_mask[None, None]
    mask = _additive(attention_mask, query.dtype)
    if fn is None:
        fn = _generic_eager
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _generic_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Eager attention for a model file without ``eager_attention_forward``: softmax(q·kᵀ·scaling + mask)·v
    in the query's dtype (softmax in float32), key/value heads repeated for grouped queries; returns
    the output as (batch, seq, heads, dim) and the probabilities, as transformers' eager functions."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _original(original, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """The call as the unpatched model would have made it."""
    if original == "eager":
        return _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def read_back_once(cache: WeakIdKeyDictionary, t: torch.Tensor, compute):
    """``compute(t)``, which reads ``t`` back to the host (a sync), once per tensor: cached on ``t``'s
    identity and _version. A model passes one mask (or bias) object to all its layers, so the read
    happens once per forward, not once per layer. Not cached while compiling or for subclasses."""
    cacheable = not torch.compiler.is_compiling() and type(t) is torch.Tensor
    hit = cache.get(t) if cacheable else None
    if hit is not None and hit[0] == t._version:
        return hit[1]
    value = compute(t)
    if cacheable:
        cache[t] = (t._version, value)
    return value


#: mask -> (its _version, its fully masked rows or None)
_DEAD_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _dead_rows(mask: torch.Tensor):
    """The (b, 1|H, q) rows of a bool mask with no allowed key, or None."""
    dead = ~mask.any(-1)
    return dead if bool(dead.any()) else None


def _masked_rows_as_eager(out, query, key, value, attention_mask, scaling, softcap=None, dead=None):
    """``out`` (b, H, s, d) plus the eager result of fully masked rows (none: ``out`` itself); ``dead``:
    those rows, when the caller knows them (context parallelism's segment ids)."""
    if dead is not None:
        pass
    elif attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return out
    elif torch.compiler.is_compiling():  # no host read in a graph: rows that are not dead add exact zeros
        dead = ~attention_mask.any(-1)
    else:
        dead = read_back_once(_DEAD_ROWS, attention_mask, _dead_rows)
        if dead is None:
            return out
    scale = query.size(-1) ** -0.5 if scaling is None else float(scaling)
    return out + EagerMaskedRows.apply(query, key, value, dead, scale, softcap)


def _weights_requested(kwargs) -> bool:
    """Whether the caller wants the attention probabilities: ``output_attentions=True`` passed down,
    or (transformers >= 5) an output collector of the running model recording attentions."""
    if kwargs.get("output_attentions", False):
        return True
    if torch.compiler.is_compiling():  # dynamo cannot trace ContextVar.get; compiled steps record none
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - transformers without output capturing
        return False
    try:
        collected = _active_collector.get()
    except LookupError:  # no collector set in this context
        return False
    return bool(collected) and any("attentions" in key for key in collected)


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
    exchange = kwargs.pop(EXCHANGE, None)
    if exchange is not None:
        return _exchanged(exchange, module, query, key, value, dropout, scaling, is_causal, kwargs)
    core = kwargs.pop(_CORE, False)
    segments, window, dead = kwargs.pop(_SEGMENTS, (None, None, None))
    state = module_state(module)
    original = state.original if state is not None else "sdpa"
    mode = state.mode if state is not None else "recompute"
    if _weights_requested(kwargs):  # as the unpatched model: eager returns them, sdpa does not
        return _original(original, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # Without dropout, no-autograd calls use the original implementation (bit-identical inference).
    # With dropout they stay on leanact's core: the first forward of a reentrant checkpoint runs
    # without autograd and the recompute with it, and both must draw the same dropout mask.
    if not needs_grad and not dropout and not core:
        return _original(original, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    bias = kwargs.pop("position_bias", None)
    if bias is not None:  # T5's relative position bias: an additive (learned) mask for the core
        if attention_mask is None and _causal(module, is_causal, query.shape[2]):
            attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        if attention_mask is not None:
            bias = bias + _additive(attention_mask[..., : key.shape[2]], bias.dtype)
        attention_mask, is_causal = bias, False
    softcap = kwargs.get("softcap")
    sinks = next((kwargs[k] for k in _SINK_KWARGS if kwargs.get(k) is not None), None)
    unsupported = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if kwargs.get("cache") is not None:
        unsupported.append("cache")
    if unsupported:
        tag = ",".join(unsupported)
        if state is not None:
            state.fallbacks.update(unsupported)
        if tag not in _warned:
            _warned.add(tag)
            warnings.warn(f"leanact attention: {tag} not supported, using the model's original {original} "
                          "attention for these calls", stacklevel=2)
        return _original(original, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)

    q_len, kv_len = query.shape[2], key.shape[2]
    # Same causal rule as transformers' sdpa function (SDPA's and leanact's is_causal are top-left).
    causal = attention_mask is None and _causal(module, is_causal, q_len)
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    extra = {} if segments is None and window is None else {"segments": segments, "window": window}
    out = _lean_attention(query, key, value, attention_mask, dropout_p=float(dropout), is_causal=causal,
                          scale=scaling, mode=mode, training=True,  # like SDPA: the caller's dropout decides
                          enable_gqa=getattr(module, "num_key_value_groups", 1) > 1, softcap=softcap, sinks=sinks,
                          **extra)
    if original == "eager" and sinks is None:  # (with sinks, eager gives such rows 0 too: the sink takes it all)
        out = _masked_rows_as_eager(out, query, key, value, attention_mask, scaling, softcap, dead)
    # out is a (b, H, s, d) view of a (b, s, H, d) buffer: this transpose is free and contiguous.
    return out.transpose(1, 2).contiguous(), None
