"""The rotation of q and k by Hugging Face's RoPE in one kernel launch each way.

Most decoder models in transformers (Llama, Mistral, Qwen2/3, Gemma 1-3, Granite, ...) call a
module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` of Llama's form from their
attention's forward. For a patched model, :func:`install`

* wraps the forward of each of its ``*RotaryEmbedding`` modules (on the instance) so that the
  (cos, sin) tables it returns carry a mark (an attribute of the two tensors), and
* replaces that modeling module's ``apply_rotary_pos_emb`` (once per module, and only where its code
  and its ``rotate_half``'s are Llama's form, compared by bytecode) by a function that sends marked
  tables to :func:`leanact.ops.rotary.rotary` (one Triton kernel for q and k each way: bitwise the
  same outputs and gradients, a sixth of the memory traffic and 2 launches a layer where HF's take 28) and
  every other call, or one the kernels do not take (a CPU, ``torch.compile``, ``torch.func``,
  other shapes), to the original function.

Unpatched models (their tables carry no mark) run the original function as before, through one
more Python call: the replacement stays in the modeling module for the process (a patched model's
RoPE module puts it back if something restored the original since). The mark travels with the
tables, so a non-reentrant gradient checkpoint recomputes what the first forward ran, and a
reentrant one (which detaches its inputs) recomputes the original's bitwise-equal outputs.
"""
from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops.rotary import rotary
from .adapter import ModelStep, PatchRun

__all__ = ["install", "uninstall", "installed", "MARK", "NOTE", "STEP"]

_ATTR = "_leanact_rotary"
MARK = "_leanact_rotary_tables"  # attribute set on the (cos, sin) tensors of a patched model
NOTE = ("rotary: q and k rotated in one kernel launch each way on CUDA ({n} RoPE module(s); "
        "bitwise Hugging Face's apply_rotary_pos_emb)")
_WRAPPED = "_leanact_original"  # attribute of the replacement: the modeling module's own function


def _rotate_half_form(x):
    """Hugging Face's ``rotate_half`` (a docstring in the first constant, as theirs)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_form(q, k, cos, sin, unsqueeze_dim=1):
    """Llama's ``apply_rotary_pos_emb`` (a docstring in the first constant, as theirs)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)  # noqa: F821 - a form compared by bytecode, never called
    k_embed = (k * cos) + (rotate_half(k) * sin)  # noqa: F821
    return q_embed, k_embed


def _same_code(fn, form) -> bool:
    """``fn`` is a plain function whose bytecode, names, arguments, defaults and non-string
    constants (the docstring aside) are ``form``'s."""
    if not isinstance(fn, types.FunctionType):
        return False
    a, b = fn.__code__, form.__code__

    def consts(c):
        return tuple(x for x in c.co_consts if not isinstance(x, str))

    return (a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames
            and a.co_argcount == b.co_argcount and consts(a) == consts(b) and fn.__defaults__ == form.__defaults__)


def _llama_form(module: types.ModuleType) -> bool:
    """Whether ``module``'s ``apply_rotary_pos_emb`` (or the original behind leanact's replacement)
    and ``rotate_half`` are Llama's form."""
    fn = getattr(module, "apply_rotary_pos_emb", None)
    fn = getattr(fn, _WRAPPED, fn)
    return _same_code(fn, _apply_form) and _same_code(getattr(module, "rotate_half", None), _rotate_half_form)


def _replacement(original):
    """``apply_rotary_pos_emb`` sending a patched model's marked tables to the kernels."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not torch.compiler.is_compiling() and unsqueeze_dim == 1 and getattr(cos, MARK, False):
            out = rotary(q, k, cos, sin)
            if out is not None:
                return out
        return original(q, k, cos, sin, unsqueeze_dim)

    setattr(apply_rotary_pos_emb, _WRAPPED, original)
    return apply_rotary_pos_emb


def _route(module: types.ModuleType) -> bool:
    """Install the replacement in ``module`` (once); False where its function is not Llama's form."""
    if not _llama_form(module):
        return False
    fn = module.apply_rotary_pos_emb
    if getattr(fn, _WRAPPED, None) is None:
        module.apply_rotary_pos_emb = _replacement(fn)
    return True


class MarkTables:
    """``forward`` of a RoPE module (set on the instance) that marks the (cos, sin) it returns, and
    routes its modeling module's rotation again where something put the original function back
    (another library's process-wide patch undone: Liger-Kernel's, swapped in and out)."""

    def __init__(self, module: nn.Module, previous=None):
        self.module, self.previous = module, previous
        self.modeling = type(module).__module__  # (a name: module objects do not deep-copy)

    def _forward(self):
        if self.previous is not None:
            return self.previous
        return functools.partial(type(self.module).forward, self.module)  # (see ContextForward)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(self._forward())

    def __call__(self, *args, **kwargs):
        out = self._forward()(*args, **kwargs)
        if (not torch.compiler.is_compiling() and isinstance(out, tuple) and len(out) == 2
                and all(isinstance(t, torch.Tensor) for t in out)):
            modeling = sys.modules.get(self.modeling)
            if (modeling is not None
                    and getattr(getattr(modeling, "apply_rotary_pos_emb", None), _WRAPPED, None) is None):
                _route(modeling)  # (a function of another form, e.g. a library's own, is left in place)
            for t in out:  # (fake tensors too: leanact.estimate models the kernels' allocations)
                setattr(t, MARK, True)
        return out


@dataclass
class _State:
    wrapped: list[tuple[nn.Module, MarkTables]] = field(default_factory=list)


def _rope_modules(model: nn.Module):
    for m in model.modules():
        t = type(m)
        if t.__name__.endswith("RotaryEmbedding") and t.__module__.startswith("transformers.models."):
            yield m, sys.modules.get(t.__module__)


def install(model: nn.Module) -> int:
    """Mark the tables of ``model``'s RoPE modules whose modeling module's rotation is Llama's form,
    and route that module's calls (module doc); returns how many RoPE modules were wrapped."""
    uninstall(model)
    state = _State()
    for m, module in _rope_modules(model):
        if module is None or "forward" in m.__dict__ or not _route(module):
            continue
        wrapper = MarkTables(m, None)
        m.__dict__["forward"] = wrapper
        state.wrapped.append((m, wrapper))
    if state.wrapped:
        object.__setattr__(model, _ATTR, state)
    return len(state.wrapped)


def installed(model: nn.Module) -> int:
    """How many RoPE modules of ``model`` mark their tables."""
    state = model.__dict__.get(_ATTR)
    return 0 if state is None else len(state.wrapped)


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (the modeling modules keep the replacement: unmarked tables go to the
    original function)."""
    state: _State | None = model.__dict__.get(_ATTR)
    if state is None:
        return
    for m, wrapper in state.wrapped:
        if m.__dict__.get("forward") is wrapper:
            del m.__dict__["forward"]
    object.__delattr__(model, _ATTR)


def _install(model: nn.Module, run: PatchRun) -> None:
    if run.attention and (n := install(model)):
        run.summary.notes.append(NOTE.format(n=n))


STEP = ModelStep("rotary", _install, lambda model, run: uninstall(model))
