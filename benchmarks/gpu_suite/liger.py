"""Liger-Kernel, where it imports: its ops for the ``ops`` part, its fused linear cross-entropy for
``head``, and its Llama patch for ``steps``, kept to its own model (:class:`AttributeSwap`).
"""
from __future__ import annotations

import contextlib
import inspect


def liger_ops():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:
        return None
    fns = {"rms": lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps),
           "ln": lambda x, w, b, eps: LigerLayerNormFunction.apply(x, w, b, eps)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return fns
    fns["swiglu"] = lambda g, u: LigerSiLUMulFunction.apply(g, u)
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return fns
    fns["rope"] = lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)
    return fns


def _shifted(labels):
    """Hugging Face's causal-LM shift: position t predicts labels[t + 1], the last one nothing."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def liger_head():
    """(loss(x, W, labels) through Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, "") or
    (None, why not)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:
        return None, ("liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss does not import "
                      f"({type(e).__name__}: {str(e)[:120]})")
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def run(x, w, labels):
        out = loss_fn(w, x.reshape(-1, x.shape[-1]), _shifted(labels).reshape(-1))
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    return run, ""


_MISSING = object()


class AttributeSwap:
    """What a process-wide patch changes in a module and in the classes it defines, undone as soon as
    it ran and put back in place only inside :meth:`active`. Liger-Kernel's Llama patch rebinds names
    of transformers' ``modeling_llama`` (the RoPE function, the RMSNorm and MLP classes) and
    ``LlamaForCausalLM.forward``: left in place, the HF sdpa and leanact models stepping in turns with
    Liger's in one process would run Liger's code."""

    def __init__(self, module):
        self.module = module
        self.changes: list = []  # (owner, name, original or _MISSING, patched or _MISSING)

    def capture(self, fn) -> None:
        mod = self.module
        owners = [mod] + [v for v in list(vars(mod).values()) if isinstance(v, type) and v.__module__ == mod.__name__]
        before = [dict(vars(o)) for o in owners]
        try:
            fn()
        finally:
            for owner, old in zip(owners, before):
                new = dict(vars(owner))
                for name in sorted(set(old) | set(new)):
                    if old.get(name, _MISSING) is not new.get(name, _MISSING):
                        self.changes.append((owner, name, old.get(name, _MISSING), new.get(name, _MISSING)))
            self._put(patched=False)

    def _put(self, patched: bool) -> None:
        for owner, name, original, changed in self.changes:
            value = changed if patched else original
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)

    @contextlib.contextmanager
    def active(self):
        self._put(patched=True)
        try:
            yield
        finally:
            self._put(patched=False)

    def describe(self) -> str:
        names = [f"{owner.__name__.rsplit('.', 1)[-1]}.{name}" for owner, name, _, _ in self.changes]
        return ", ".join(names) or "nothing"


LIGER_LLAMA = dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)


def liger_llama_patch():
    """The installed Liger-Kernel's Llama patch: ``(("before", fn()), what)`` for
    ``apply_liger_kernel_to_llama`` with the :data:`LIGER_LLAMA` options this version takes (run
    before building), ``(("instance", fn(model)), what)`` for ``_apply_liger_kernel_to_instance``,
    or ``(None, why not)``."""
    try:
        import liger_kernel.transformers as lt
    except Exception as e:
        return None, f"liger_kernel does not import ({type(e).__name__}: {str(e)[:120]})"
    apply = getattr(lt, "apply_liger_kernel_to_llama", None)
    if apply is not None:
        try:
            params = inspect.signature(apply).parameters
            anything = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            params, anything = {}, True
        kwargs = {k: v for k, v in LIGER_LLAMA.items() if anything or k in params}
        what = f"apply_liger_kernel_to_llama({', '.join(f'{k}={v}' for k, v in kwargs.items())}) before building"
        left = [k for k in LIGER_LLAMA if k not in kwargs]
        if left:
            what += f" (this version takes no {', '.join(left)})"
        return ("before", lambda: apply(**kwargs)), what
    inst = getattr(lt, "_apply_liger_kernel_to_instance", None)
    if inst is not None:
        return ("instance", lambda model: inst(model=model)), ("_apply_liger_kernel_to_instance(model=...) on the "
                                                                "built model")
    return None, "liger_kernel.transformers has neither apply_liger_kernel_to_llama nor _apply_liger_kernel_to_instance"
