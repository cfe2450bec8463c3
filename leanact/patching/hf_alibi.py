"""Hugging Face's Bloom and Falcon attention (ALiBi or rotary, written inside the modeling code rather
than through ``AttentionInterface``) -> a subclass whose scores -> ALiBi, mask -> softmax -> dropout
-> @ v run through :func:`leanact.ops.attention.attention`: nothing of size s² is kept.

What stays Hugging Face's: the fused QKV projection and its split into heads (the module's own
``_reshape`` / ``_split_heads``), Falcon's rotary embedding (``apply_rotary_pos_emb`` of its modeling
file) and the dense output projection (with Bloom's ``pretraining_tp`` slices and ``dropout_add``).
The forward in between is a line-for-line rewrite of HF's, so the class is replaced only when its
``forward`` normalised source (:func:`leanact.patching.source.forward_body`) is one that rewrite
was checked against (transformers 5.17 to 5.23); any other is left with that reason.

The mask Hugging Face passes is (b, 1|H, s, s): the causal triangle and the padded keys, plus, for
Falcon with ALiBi, ALiBi / sqrt(d) on the allowed entries. When it is exactly that (checked once per
mask tensor, by rows of query blocks: no s² temporary), its last row is a per-key bias: the core
gets that row (padded keys -inf), the model's ALiBi term and ``is_causal``, a (b, H, 1, s) fp32
bias instead of any s² tensor. Scores per model (scale = 1/sqrt(d), bias on top):

* Bloom: ``alibi * beta + q k^T / sqrt(d) + mask``, softmax, dropout (``attention_dropout.p``);
* Falcon with ALiBi, ``"sdpa"``: ``q k^T / sqrt(d) + mask`` (the mask carries ALiBi), dropout;
  ``"eager"``: ``(q k^T + alibi) / sqrt(d) + mask`` (ALiBi twice, as HF's eager code has it), dropout;
* Falcon with rotary embeddings: ``q k^T / sqrt(d) + mask``, no dropout (HF applies none).

Query rows whose keys are all masked (left padding) get what HF computes: with an additive mask of
dtype-min values the uniform average of all values (without dropout on those rows), with SDPA's
bool mask 0 (:class:`leanact.ops.attention.masked_rows.EagerMaskedRows`).

Calls run HF's own forward when: no autograd and no dropout (inference is bit-identical), a cache
(``layer_past``), ``output_attentions=True``, arguments the rewrite does not know (``head_mask``),
a mask that is not causal + padding, or ``torch.func`` transforms / ``torch.compile`` tracing; the
features among these that lost leanact's attention in training (cache, mask, arguments) are recorded
in the state's ``fallbacks`` (shown by ``leanact.summary``).

Precision: the core accumulates scores and softmax in fp32 (fp64 for fp64 inputs). In fp32 this is
HF's computation up to the order of roundings (outputs within ~1e-6 relative); in bf16 HF rounds the
scores (Bloom's ``baddbmm``) or the probabilities to bf16 and leanact does not, so the patched model
is at least as close to the float64 result (tests: within 2x HF's own error).
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from ..ops import fake_rules
from ..ops.attention import attention as _lean_attention
from ..ops.transforms import functorch_active
from ..ops.attention.masked_rows import EagerMaskedRows
from .attention_hf import read_back_once
from .adapter import ModelStep, PatchRun
from .modules import hooks_reason, reclass
from .source import forward_body

__all__ = ["is_hf_alibi_attention", "hf_alibi_replacement", "has_lean", "AlibiState", "ROWS", "STEP"]

#: sha256 (first 16 hex digits) of the normalised forward bodies the rewrite below reproduces.
_KNOWN = {
    "BloomAttention": {"483d23113e1c5d83"},  # transformers 5.17 - 5.23
    "FalconAttention": {"b9e6e175ed05d291"},  # transformers 5.17 - 5.23
}
ROWS = 256  # query rows per block when checking a mask's structure


class AlibiState:
    """Per patched model: the attention mode and the features that sent training calls to HF's forward."""

    def __init__(self, mode: str):
        self.mode = mode
        self.fallbacks: set = set()


def is_hf_alibi_attention(m: nn.Module) -> bool:
    t = type(m)
    return t.__name__ in _KNOWN and t.__module__.startswith(("transformers.models.bloom.",
                                                              "transformers.models.falcon."))


def has_lean(model: nn.Module) -> bool:
    """Whether ``model`` holds an attention module replaced by this patcher."""
    return any(isinstance(m, _LeanAlibiAttention) for m in model.modules())


def _forward_reason(t: type) -> str | None:
    body = forward_body(t.forward)
    if body is None:
        return "forward source unavailable: cannot check what leanact would replace"
    digest = hashlib.sha256(body[1].encode()).hexdigest()[:16]
    if digest not in _KNOWN[t.__name__]:
        return (f"{t.__name__}.forward is not the one leanact's rewrite reproduces (transformers 5.17-5.23): "
                "left as is")
    return None


def hf_alibi_replacement(m: nn.Module, state: AlibiState) -> tuple[nn.Module | None, str | None]:
    """(lean subclass instance sharing m's children and Parameters, None) or (None, reason)."""
    t = type(m)
    if isinstance(m, _LeanAlibiAttention):
        return None, None
    if (reason := hooks_reason(m)) is not None:
        return None, reason
    if (reason := _forward_reason(t)) is not None:
        return None, reason
    if "forward" in m.__dict__:
        return None, "forward replaced on the instance"
    return reclass(m, _LeanAlibiAttention, _leanact_alibi=state), None


# The structure of the last mask checked: (weakref to it, causal?, per-key bias row or None).
_CHECKED: list = [None]
#: per-key bias -> (its _version, rows with no allowed key or None): one bias object serves every layer
_DEAD_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


#: inside a leanact.estimate trace (its fake-tensor rule in force): fake masks are taken as built from a 2-D mask
_ESTIMATING = [0]


@contextlib.contextmanager
def _estimating(run):
    _ESTIMATING[0] += 1
    try:
        yield
    finally:
        _ESTIMATING[0] -= 1


fake_rules.register("hf_alibi_mask", rule=_estimating)


def _dead_rows(bias: torch.Tensor):
    """The causal rows (b, 1|H, s) of a per-key bias (b, 1|H, 1, s) that see no allowed key, or None.
    None for a fake bias (``leanact.estimate``: no values to tell), so an estimate does not count what
    left padding's rows that see no key keep (:class:`EagerMaskedRows`: their bool mask; for Falcon's
    ALiBi layers also q, k and v, which its core does not keep)."""
    if is_fake(bias):
        return None
    valid = bias.isfinite().squeeze(2)  # (b, 1|H, s)
    dead = valid.cumsum(-1) == 0  # row i: no allowed key among 0..i
    return dead if bool(dead.any()) else None


def _key_bias(mask: torch.Tensor) -> tuple[bool, torch.Tensor] | None:
    """(causal, bias (b, 1|H, 1, s) with -inf on masked keys) if ``mask`` (b, 1|H, s, s), bool or
    additive float, is the causal triangle over that per-key row; None if it is anything else. A fake
    mask has no values to compare: inside ``leanact.estimate`` it is taken as the causal triangle over
    its last row, which is what Hugging Face builds from a 2-D ``attention_mask`` (a memory estimate,
    no gradient depends on it); in any other fake trace it is None (Hugging Face's forward)."""
    hit = _CHECKED[0]
    if hit is not None and hit[0]() is mask:
        return hit[1]
    found = None
    if is_fake(mask) and not _ESTIMATING[0]:
        return None
    if mask.dim() == 4 and mask.size(-1) == mask.size(-2):
        s = mask.size(-1)
        last = mask[:, :, -1:, :]
        masked_value = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        allowed = last if mask.dtype == torch.bool else last != masked_value
        ok = True
        for i0 in range(0, 0 if is_fake(mask) else s, ROWS):
            i1 = min(s, i0 + ROWS)
            tri = torch.arange(s, device=mask.device) <= torch.arange(i0, i1, device=mask.device).unsqueeze(1)
            expect = torch.where(tri & allowed, last, torch.full((), masked_value, dtype=mask.dtype,
                                                                      device=mask.device))
            if not torch.equal(mask[:, :, i0:i1], expect):
                ok = False
                break
        if ok:
            c = torch.float64 if mask.dtype == torch.float64 else torch.float32
            values = torch.zeros((), dtype=c, device=mask.device) if mask.dtype == torch.bool else last.to(c)
            found = (True, torch.where(allowed, values, -torch.inf))
    _CHECKED[0] = (weakref.ref(mask), found)
    return found


class _LeanAlibiAttention:
    """Mixin placed before Bloom's / Falcon's attention class (see the module docstring)."""

    _leanact_lean = True

    def forward(self, hidden_states, *args, **kwargs):
        hf = type(self).__mro__[2]  # the original HF class (Lean subclass -> mixin -> HF class)
        bloom = hf.__name__ == "BloomAttention"
        names = (("residual", "alibi", "attention_mask", "layer_past", "use_cache", "output_attentions") if bloom
                 else ("alibi", "attention_mask", "position_ids", "layer_past", "use_cache", "output_attentions",
                       "position_embeddings"))
        call = dict(zip(names, args), **kwargs)
        state = self.__dict__.get("_leanact_alibi")
        drop = self.attention_dropout
        p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
        if not bloom and call.get("alibi") is None:
            p = 0.0  # Falcon applies no attention dropout with rotary embeddings
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            q.requires_grad for q in self.query_key_value.parameters()))
        why = self._leanact_why(call, bloom)
        if why is not None or (not grad and not p) or torch.compiler.is_compiling() or functorch_active():
            if why is not None and why != "-" and grad and state is not None:
                state.fallbacks.add(why)
            return hf.forward(self, hidden_states, *args, **kwargs)
        key = _key_bias(call["attention_mask"]) if call.get("attention_mask") is not None else (False, None)
        if key is None:
            if grad and state is not None:
                state.fallbacks.add("attention mask other than causal + padding")
            return hf.forward(self, hidden_states, *args, **kwargs)
        mode = state.mode if state is not None else "recompute"
        return (self._leanact_bloom if bloom else self._leanact_falcon)(hidden_states, call, key, p, mode)

    def _leanact_why(self, call, bloom) -> str | None:
        """Why this call runs HF's forward ("-": not worth recording), or None."""
        known = {"residual", "alibi", "attention_mask", "layer_past", "use_cache", "output_attentions",
                 "position_ids", "position_embeddings"}
        if call.get("output_attentions"):
            return "-"
        if call.get("layer_past") is not None:
            return "cache"
        extra = sorted(k for k, v in call.items() if k not in known and v is not None)
        if extra:
            return ", ".join(extra)
        mask = call.get("attention_mask")
        if mask is not None and mask.dtype == torch.bool and (bloom or self.config._attn_implementation != "sdpa"):
            return "-"  # HF's eager code adds a bool mask: left to it
        if not bloom and mask is None and self.config._attn_implementation != "sdpa":
            return "-"  # HF's eager code needs a mask
        return None

    def _core(self, q, k, v, key, extra_bias, p, scale, mode, uniform_dead_rows):
        """(b, H, s, d) attention output: the core on the per-key bias (+ ``extra_bias``), then HF's
        result for query rows whose keys are all masked."""
        causal, bias = key
        if extra_bias is not None:
            bias = extra_bias if bias is None else bias + extra_bias
        out = _lean_attention(q, k, v, bias, dropout_p=p, is_causal=causal, scale=scale, mode=mode,
                              training=True, enable_gqa=k.size(1) != q.size(1))
        if uniform_dead_rows and causal and key[1] is not None:
            dead = read_back_once(_DEAD_ROWS, key[1], _dead_rows)  # once per forward
            if dead is not None:
                out = out + EagerMaskedRows.apply(q, k, v, dead, scale)
        return out

    def _leanact_bloom(self, hidden_states, call, key, p, mode):
        """BloomAttention.forward with the scores -> @ v part through leanact's core."""
        batch_size, q_length, _ = hidden_states.shape
        fused_qkv = self.query_key_value(hidden_states)
        query_layer, key_layer, value_layer = self._reshape(fused_qkv)
        alibi = call["alibi"]
        c = torch.float64 if query_layer.dtype == torch.float64 else torch.float32
        alibi = alibi.view(batch_size, self.num_heads, 1, -1).to(c) * self.beta
        uniform = call.get("attention_mask") is not None  # Bloom's mask is additive
        out = self._core(query_layer, key_layer, value_layer, key, alibi, p, self.inv_norm_factor, mode, uniform)
        context_layer = out.transpose(1, 2).reshape(batch_size, q_length, self.num_heads * self.head_dim)
        if self.pretraining_tp > 1 and self.slow_but_exact:
            slices = self.hidden_size / self.pretraining_tp
            output_tensor = torch.zeros_like(context_layer)
            for i in range(self.pretraining_tp):
                output_tensor = output_tensor + F.linear(
                    context_layer[:, :, int(i * slices): int((i + 1) * slices)],
                    self.dense.weight[:, int(i * slices): int((i + 1) * slices)],
                )
        else:
            output_tensor = self.dense(context_layer)
        dropout_add = sys.modules[type(self).__mro__[2].__module__].dropout_add
        output_tensor = dropout_add(output_tensor, call["residual"], self.hidden_dropout, self.training)
        return output_tensor, None

    def _leanact_falcon(self, hidden_states, call, key, p, mode):
        """FalconAttention.forward with the scores -> @ v part through leanact's core."""
        fused_qkv = self.query_key_value(hidden_states)
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape
        query_layer = query_layer.transpose(1, 2).reshape(batch_size, self.num_heads, query_length, self.head_dim)
        key_layer = key_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
        alibi = call.get("alibi")
        if alibi is None:
            cos, sin = call["position_embeddings"]
            rotary = sys.modules[type(self).__mro__[2].__module__].apply_rotary_pos_emb
            query_layer, key_layer = rotary(query_layer, key_layer, cos, sin)
        sdpa = self.config._attn_implementation == "sdpa"
        extra = None
        if alibi is not None and not sdpa:  # HF's eager ALiBi: (q k^T + alibi) / sqrt(d) + mask
            c = torch.float64 if query_layer.dtype == torch.float64 else torch.float32
            extra = alibi.view(batch_size, self.num_heads, 1, -1).to(c) * self.inv_norm_factor
        mask = call.get("attention_mask")
        if mask is None:  # HF's SDPA call: is_causal for more than one query
            key = (query_length > 1, None)
        uniform = mask is not None and mask.dtype != torch.bool
        out = self._core(query_layer, key_layer, value_layer, key, extra, p, self.inv_norm_factor, mode, uniform)
        attn_output = out.transpose(1, 2).reshape(batch_size, query_length, self.num_heads * self.head_dim)
        return self.dense(attn_output), None


def install(model: nn.Module, run: PatchRun) -> None:
    """Swap Bloom's / Falcon's attention modules for their lean twin, all sharing one :class:`AlibiState`
    (``run.state["alibi"]``, read by the attention step; absent when none was swapped)."""
    if not run.attention:
        return
    state = AlibiState(run.attention)
    found = False
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not is_hf_alibi_attention(child):
                continue
            qual = f"{prefix}.{name}" if prefix else name
            new, reason = hf_alibi_replacement(child, state)
            if new is None:
                if reason is not None:
                    run.summary.left.append((qual, type(child).__name__, reason))
                continue
            run.swap(parent, name, new, f"leanact.patching.{type(new).__name__}", qual)
            found = True
    if found:
        run.state["alibi"] = state


STEP = ModelStep("alibi", install)
