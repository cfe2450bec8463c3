"""Hugging Face language-model heads: the loss through leanact's fused linear + cross-entropy.

``*ForCausalLM``, ``*LMHeadModel`` (GPT-2), ``*ForMaskedLM`` and ``*ForConditionalGeneration``
(vision-language models such as LLaVA; T5, Whisper) models compute
``logits = lm_head(hidden)`` (possibly soft-capped, as Gemma 2/3) and then the loss from the
logits: ``self.loss_function`` (``ForCausalLMLoss``: shift, ``num_items_in_batch``, upcast, then
``F.cross_entropy``) or ``CrossEntropyLoss()`` directly (BERT, RoBERTa masked LM). All paths end in
``F.cross_entropy`` on a view of the (upcast, capped) logits. leanact hooks the model, not these
functions, so that whatever the model does between its head and ``F.cross_entropy`` is the model's
own code:

1. the model's forward (wrapped on the instance, :class:`_HeadForward`) arms the call when the model
   is in training mode and gets ``labels`` with autograd on (as Liger-Kernel's ``skip_logits =
   self.training and labels is not None``; not under ``torch.no_grad``, ``generate``,
   ``model.eval()``, ``torch.compile`` tracing, ``torch.func`` or :func:`keep_logits`), and the
   output embedding (``get_output_embeddings()``) is a plain ``nn.Linear`` without hooks;
2. the head's next call then returns a *placeholder* of the logits' shape and dtype (a zero-stride
   view of one element, no memory) and remembers its input; a ``TorchFunctionMode`` watches every
   torch function that touches the placeholder until the model returns:
   - upcasts, views/reshapes keeping the vocabulary dimension, multiplication/division by Python
     numbers and one ``tanh`` (soft-capping ``c·tanh(z/c)``, a logit scale) are recorded;
   - ``F.cross_entropy`` (class-index targets, no class weights) on it runs
     :func:`leanact.ops.cross_entropy.function.linear_cross_entropy` on the head's input, weight and
     bias with the recorded scale and cap: the same loss, keeping 8 bytes per token;
   - reading shape, dtype, device is answered by the placeholder;
   - an operation that only reads (an aten operator none of whose overloads writes an argument, no
     ``out=``, no ``inplace=True``: ``logsumexp`` for a z-loss, ``argmax`` for a metric) runs on the
     real logits, computed once (the head's own forward, then the recorded operations replayed, each
     in its call's grad mode); the placeholders stay, so the loss can still be fused, and
     ``leanact.summary`` lists the operation under the head's fallbacks;
   - anything that writes, or is not known not to (``div_``, ``masked_fill_``, ``z[...] = v``,
     ``.data = v``, ``+=``, ``copy_``, ``out=``, ``F.relu(z, inplace=True)``, a name aten lacks), or a
     read whose result aliases the logits (a view, ``detach``) *realises* them first: every live
     placeholder becomes in place (``torch.utils.swap_tensors``) the real tensor it stands for,
     parents first, so views are views of the real logits and upcasts copies, as in the unfused
     model; the write then reaches every tensor derived from the logits, and the model's own code
     runs on, unfused (exact). Where a placeholder cannot be swapped (a weak reference to it, a saved
     tensor) this raises, naming the ways out below; a write the mode could not see (versions
     changed) raises too, never a fused loss of stale logits. Fake tensors (``leanact.estimate``) are
     not swapped: the rest of the call runs on computed values, unfused, as the real step;
3. the wrapper closes the window in ``finally`` (nothing leaks when the forward raises, a
   ``KeyboardInterrupt`` included) and cleans the output: ``logits`` is None
   when the fused loss consumed them (as Liger-Kernel's fused loss returns them), the real logits
   otherwise; with ``return_dict=False`` the logits drop out of the tuple, as a None field does.

Logits the user wants: pass no labels (compute the loss yourself), call the model in eval mode or
inside ``with leanact.keep_logits():``, or ``leanact.patch(model, fused_loss=False)``. Generation
and evaluation are untouched, so their logits are bit-identical.
Tied embeddings: the head's weight Parameter is used as is (gradients reach the tied embedding).
Higher-order gradients: the fused loss computes its gradients in the forward (``grad_in_forward``),
so under ``create_graph=True`` they come back with their values but raise, naming these ways out,
when differentiated (a gradient penalty, a Hessian-vector product; leanact cannot know in advance
that one will come): :mod:`leanact.ops.cross_entropy.function`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..ops.amp import autocast_dtype, autocast_off
from ..ops.cross_entropy import linear_cross_entropy
from ..ops.transforms import functorch_active
from ..recompute.context_forward import ContextForward
from .modules import RUN_TIME_HOOKS, hook_kinds
from .adapter import ModelStep, PatchRun
from .head_writes import cast_dtype, fusable_call, name_of, writes as _writes
from .hf_head_compiled import CompiledWindow, LazyLogits
from .hf_head_loss_form import loss_form, loss_outside

__all__ = ["ATTR", "HeadState", "keep_logits", "install", "uninstall", "head_reason", "ELIGIBLE_SUFFIXES", "STEP"]

ATTR = "_leanact_head"
ELIGIBLE_SUFFIXES = ("ForCausalLM", "ForMaskedLM", "LMHeadModel", "ForConditionalGeneration")

_local = threading.local()


@contextlib.contextmanager
def keep_logits():
    """Inside this block patched models compute their loss the unfused way and return their logits."""
    _local.keep = getattr(_local, "keep", 0) + 1
    try:
        yield
    finally:
        _local.keep -= 1


@dataclass
class HeadState:
    """Per patched model: the head's path, whether fusing is on, and what happened at run time."""

    path: str
    enabled: bool = True
    fused_calls: int = 0
    #: operation name -> count: operations the placeholder could not stand for, run on the real logits
    #: (computed once; the loss stays fused), or, after a write into them or an alias of them taken,
    #: on the placeholders made the real tensors (the loss is then the model's own, unfused).
    fallbacks: dict = field(default_factory=dict)
    windows: list = field(default_factory=list, repr=False, compare=False)
    #: the model's own ``loss_type`` when leanact named the loss it falls back to (:func:`_name_loss_type`)
    loss_type_was: tuple | None = None
    #: :func:`~.hf_head_loss_form.loss_form` of the model's class, read when patched (not while compiling),
    #: and the class's ``forward`` it was read from (it holds while that is still the forward called)
    loss_form: str | None = None
    loss_form_of: object = field(default=None, repr=False, compare=False)

    def __getstate__(self):  # copies and pickles carry no open call
        d = dict(self.__dict__)
        d["windows"] = []
        return d

    def __deepcopy__(self, memo):
        new = HeadState(self.path, self.enabled, self.fused_calls, dict(self.fallbacks),
                        loss_type_was=self.loss_type_was, loss_form=self.loss_form, loss_form_of=self.loss_form_of)
        memo[id(self)] = new
        return new


def head_reason(model: nn.Module) -> str | None:
    """None if ``model``'s output embedding can be fused, else why not."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return "no output embedding (get_output_embeddings() is None)"
    if type(head) is not nn.Linear:
        return f"the output embedding is {type(head).__name__}, not nn.Linear"
    kinds = hook_kinds(head, RUN_TIME_HOOKS)
    if kinds:
        return f"the output embedding has hooks ({', '.join(kinds)})"
    if "forward" in head.__dict__:
        return "the output embedding's forward was replaced on the instance"
    return None


def eligible_class(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel) and type(model).__name__.endswith(ELIGIBLE_SUFFIXES)


# ---- the placeholder and the mode ------------------------------------------------------------

class _Entry:
    """One placeholder: a weak reference to it (only live ones are ever made real), the entry it was
    derived from by ``op`` and the grad mode then, every operation since the head's output (``ops``:
    what the fused loss reads), its version, and once computed its values (``real``) and their
    version then."""

    __slots__ = ("ref", "parent", "op", "grad", "ops", "version", "real", "real_version")

    def __init__(self, t, parent=None, op=None):
        self.ref, self.parent, self.op, self.grad = weakref.ref(t), parent, op, torch.is_grad_enabled()
        self.ops = () if parent is None else parent.ops + (op,)
        self.version, self.real, self.real_version = t._version, None, None


_SELF = object()
_META_PROPS = {"shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "layout", "requires_grad", "is_leaf",
               "is_sparse", "is_quantized", "is_nested"}
_META_FUNCS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.numel, torch.Tensor.nelement,
               torch.Tensor.ndimension, torch.Tensor.is_floating_point, torch.Tensor.get_device,
               torch.Tensor.element_size, torch.Tensor.is_complex}
_SHAPE_FUNCS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
                torch.Tensor.contiguous}
_MUL_FUNCS = {torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul, torch.multiply,
              torch.Tensor.multiply}
_DIV_FUNCS = {torch.Tensor.div, torch.Tensor.__truediv__, torch.div, torch.true_divide, torch.Tensor.true_divide,
              torch.Tensor.divide, torch.divide}
_TANH_FUNCS = {torch.tanh, torch.Tensor.tanh}
_CAST_FUNCS = {torch.Tensor.float, torch.Tensor.double, torch.Tensor.to}
_WAYS_OUT = ("compute this loss unfused: leanact.patch(model, fused_loss=False), `with leanact.keep_logits():` "
             "around the forward, or leanact.unpatch(model)")


def _plain(t) -> bool:
    """A plain (or fake: leanact.estimate) tensor or Parameter, not a tensor subclass such as DTensor."""
    return type(t) in (torch.Tensor, nn.Parameter) or is_fake(t)


_name = name_of


def _scalar(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)


class _Window(TorchFunctionMode):
    """One armed forward call: from the head's call until the model returns."""

    def __init__(self, state: HeadState, head: nn.Linear):
        super().__init__()
        self.state, self.head = state, head
        self.entries: dict[int, _Entry] = {}
        self.x = None
        self.ac = None
        self.entered = False
        self.consumed = False
        self.unfused = False  # fake tensors after a write: the placeholders stay, nothing more is fused

    # -- the head's capture
    def capture(self, input):
        head = self.head
        head.__dict__.pop("forward", None)  # one call only
        x = input
        w = head.weight
        ok = (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == head.in_features and x.is_floating_point()
              and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
              and x.device == w.device and _plain(x) and _plain(w))
        ac = autocast_dtype(x.device.type) if ok else None
        if ok and ac is not None and x.dtype in (torch.float16, torch.bfloat16, torch.float32) \
                and w.dtype in (torch.float16, torch.bfloat16, torch.float32):
            dtype = ac
        elif ok and ac is None and x.dtype == w.dtype and (head.bias is None or head.bias.dtype == w.dtype):
            dtype = x.dtype
        else:
            return nn.Linear.forward(head, input)  # its own forward (raises as it would on bad input)
        self.x, self.ac = x, ac
        p = self._placeholder(x.shape[:-1] + (head.out_features,), dtype, x.device)
        self.__enter__()
        self.entered = True
        return p

    def _placeholder(self, shape, dtype, device, parent=None, op=None):
        """A zero-stride view of one element (no memory) standing for the logits or ``op`` of ``parent``'s."""
        p = torch.empty((), dtype=dtype, device=device).expand(*shape)
        self.entries[id(p)] = _Entry(p, parent, op)
        return p

    # -- materialising
    def materialise(self, e: _Entry):
        """The values ``e`` stands for, computed once: the head's own forward, then e's operations, each
        in the grad mode of its call."""
        if e.real is None:
            with _mode_off(self), torch.set_grad_enabled(e.grad):
                if e.parent is None:
                    v = nn.Linear.forward(self.head, self.x) if self.ac is None else _with_autocast(
                        self.x.device.type, self.ac, nn.Linear.forward, self.head, self.x)
                else:
                    base = self.materialise(e.parent)
                    func, args, kwargs = e.op
                    v = func(*[base if a is _SELF else a for a in args], **kwargs)
            e.real, e.real_version = v, v._version
        return e.real

    def realise(self):
        """Every live placeholder becomes in place (``torch.utils.swap_tensors``: the objects the model's
        code holds stay the same) the tensor it stands for, parents first: a view of the logits is then
        a view of the real logits and an upcast a copy, as in the unfused model, so a write into any of
        them reaches the others and the loss. None is left: the model's own code runs on, unfused.
        A value computed before (and maybe held by autograd) or a no-op (``.float()`` of fp32) is
        swapped in as an alias (a view of it). Fake tensors (``leanact.estimate``; torch holds weak
        references to their views) are not swapped: their values do not matter, and every later
        operation runs on computed values, unfused, as the real step would."""
        if is_fake(self.x):
            self.unfused = True
            return
        entries, self.entries = list(self.entries.values()), {}
        with _mode_off(self):
            for e in entries:
                t, e.ref = e.ref(), None  # (swap_tensors refuses a tensor with weak references)
                if t is None:
                    continue
                fresh = e.real is None
                r = self.materialise(e)
                _swap(t, r if fresh and (e.parent is None or r is not e.parent.real) else r.view_as(r))
                e.real = t

    def _entry(self, a):
        e = self.entries.get(id(a)) if isinstance(a, torch.Tensor) else None
        return e if e is not None and e.ref() is a else None

    def _find(self, obj, out):
        e = self._entry(obj)
        if e is not None:
            out.append(e)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                self._find(o, out)
        elif isinstance(obj, dict):
            for o in obj.values():
                self._find(o, out)
        return out

    def _replace(self, obj):
        e = self._entry(obj)
        if e is not None:
            return self.materialise(e)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*(self._replace(o) for o in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._replace(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._replace(v) for k, v in obj.items()}
        return obj

    def _check(self):
        """Every placeholder and every value computed for one is as it was: a write the mode did not see
        (an operator called with the mode switched off) raises rather than fuse stale logits."""
        for e in self.entries.values():
            t = e.ref()
            if (t is not None and t._version != e.version) or (e.real is not None
                                                                  and e.real._version != e.real_version):
                raise RuntimeError("leanact's fused LM head: the logits (or a tensor derived from them) were "
                                   "written in place where leanact could not see it; " + _WAYS_OUT)

    def _derive(self, e: _Entry, func, args, kwargs, shape=None, dtype=None):
        t = e.ref()
        op = (func, tuple(_SELF if a is t else a for a in args), dict(kwargs))
        return self._placeholder(t.shape if shape is None else tuple(shape), t.dtype if dtype is None else dtype,
                                 t.device, e, op)

    # -- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = self._find((args, kwargs), [])
        if not found:
            return func(*args, **kwargs)
        if func is F.cross_entropy:
            out = self._cross_entropy(args, kwargs)
            if out is not None:
                return out
        elif _name(func) in _META_PROPS or func in _META_FUNCS:
            return func(*args, **kwargs)
        elif func is torch.Tensor.untyped_storage and len(args) == 1:
            return func(*args)  # the placeholder's one element: what exists (memory trackers ask this)
        elif len(found) == 1 and args and (args[0] is found[0].ref() or (func in _MUL_FUNCS and len(args) == 2
                                                                          and args[1] is found[0].ref())):
            out = self._deferred(found[0], func, args, kwargs)
            if out is not None:
                return out
        name = _name(func)
        self.state.fallbacks[name] = self.state.fallbacks.get(name, 0) + 1
        if not self.unfused and not _writes(func, args, kwargs):
            return self._compute(func, args, kwargs)
        self.realise()
        return self._run(func, args, kwargs)

    def _run(self, func, args, kwargs):
        """``func`` on real tensors: the placeholders' computed values where some are left (none after
        :meth:`realise`, but for fake tensors)."""
        return func(*self._replace(args), **self._replace(kwargs))

    def _compute(self, func, args, kwargs):
        """``func``, which writes into no argument, on the placeholders' values (they stay placeholders).
        When its result shares their memory (a view, ``detach``, ``.data``), a write through it must
        reach the logits: the placeholders are made real and ``func`` runs again on them."""
        out = self._run(func, args, kwargs)
        reals = [e.real for e in self.entries.values() if e.real is not None]
        if any(isinstance(o, torch.Tensor) and any(torch._C._is_alias_of(o, r) for r in reals)
               for o in tree_leaves(out)):
            out = reals = None
            self.realise()
            return self._run(func, args, kwargs)
        self._check()
        return out

    def _deferred(self, e: _Entry, func, args, kwargs):
        t = e.ref()
        v = self.head.out_features
        if func in _SHAPE_FUNCS:
            if _name(func) == "contiguous" and len(args) == 1 and not kwargs:
                return t  # (what it stands for is contiguous: torch returns the tensor itself)
            with _mode_off(self):
                # a zero-stride meta view: no allocation (under FakeTensorMode a full-size meta tensor
                # would be counted by a memory tracker)
                meta = torch.empty((), device="meta").expand(t.shape)
                shape = func(meta, *args[1:], **kwargs).shape
            if len(shape) >= 1 and shape[-1] == v:
                return self._derive(e, func, args, kwargs, shape=shape)
            return None
        if func in _CAST_FUNCS:
            dtype = _cast_dtype(func, t, args[1:], kwargs)
            if dtype == t.dtype:
                return t  # (the tensor itself, as torch returns it)
            if dtype is not None:
                return self._derive(e, func, args, kwargs, dtype=dtype)
            return None
        if func in _MUL_FUNCS and len(args) == 2 and not kwargs:
            other = args[1] if args[0] is t else args[0]
            return self._derive(e, func, args, kwargs) if _scalar(other) else None
        if func in _DIV_FUNCS and len(args) == 2 and args[0] is t and not kwargs:
            return self._derive(e, func, args, kwargs) if _scalar(args[1]) and args[1] != 0 else None
        if func in _TANH_FUNCS and len(args) == 1 and not kwargs:
            return self._derive(e, func, args, kwargs)
        return None

    def _cross_entropy(self, args, kwargs):
        if self.unfused:
            return None
        try:
            b = _CE_SIG.bind(*args, **kwargs)
        except TypeError:
            return None
        a = b.arguments
        z, target = a.get("input"), a.get("target")
        e = self._entry(z)
        if (e is None or self._entry(target) is not None
                or not fusable_call(a, z, target, math.prod(self.x.shape[:-1]))):
            return None
        form = _logit_form(e.ops)
        if form is None:
            return None
        self._check()
        scale, softcap = form
        x = self.x.reshape(-1, self.x.shape[-1])
        with _mode_off(self):
            ctx = (torch.autocast(x.device.type, dtype=self.ac) if self.ac is not None else autocast_off(x.device.type))
            with ctx:
                loss = linear_cross_entropy(x, self.head.weight, target, self.head.bias,
                                            ignore_index=a.get("ignore_index", -100),
                                            reduction=a.get("reduction", "mean"),
                                            label_smoothing=a.get("label_smoothing", 0.0), scale=scale, softcap=softcap,
                                            grad_in_forward=True)
            if loss.dtype != z.dtype and self.ac is None:  # (autocast runs cross_entropy in fp32: fp32 loss)
                loss = loss.to(z.dtype)
        self.consumed = True
        self.state.fused_calls += 1
        return loss


_CE_SIG = inspect.signature(F.cross_entropy)


def _swap(t, r) -> None:
    """``t`` (a placeholder) becomes ``r`` in place; ``r`` when held elsewhere (a saved tensor) as a view
    of it. Raises leanact's error when ``t`` itself is held where it cannot be swapped."""
    try:
        torch.utils.swap_tensors(t, r)
        return
    except RuntimeError:
        pass
    try:
        torch.utils.swap_tensors(t, r.view_as(r))
    except RuntimeError as err:
        raise RuntimeError(f"leanact's fused LM head: the loss code writes into the logits (or a tensor derived "
                           f"from them) or takes an alias of them, so the placeholder leanact returned for them "
                           f"must become the real tensor, which it cannot here ({err}); {_WAYS_OUT}") from err


def _cast_dtype(func, t, args, kwargs):
    """The dtype of a cast (``float``, ``double``, ``to``) that keeps the logits' precision or raises it."""
    if func not in _CAST_FUNCS:
        return None
    return cast_dtype(_name(func), t, args, kwargs)


def _logit_form(ops) -> tuple[float, float | None] | None:
    """(scale, softcap) when the recorded operations are z ↦ [c·tanh](s·z) with upcasts and views
    anywhere; None otherwise. Division is kept exact: Gemma's z/c·… ·c gives scale exactly 1."""
    num, den, post, tanh = 1.0, 1.0, 1.0, False
    for func, args, _ in ops:
        if func in _SHAPE_FUNCS or func in _CAST_FUNCS:
            continue
        if func in _TANH_FUNCS:
            if tanh:
                return None
            tanh = True
            continue
        other = args[1] if args[0] is _SELF else args[0]
        if func in _MUL_FUNCS:
            if tanh:
                post *= other
            else:
                num *= other
        elif func in _DIV_FUNCS:
            if tanh:
                post /= other
            else:
                den *= other
        else:
            return None
    if not tanh:
        return num / den, None
    if not post > 0:
        return None
    return (num * post) / den if (num * post) != den else 1.0, post


class _mode_off:
    """Run with this window's mode switched off (its own computations are not intercepted)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.ctx = torch.overrides._pop_mode_temporarily() if _top_is(self.mode) else contextlib.nullcontext()
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def _top_is(mode) -> bool:
    stack = torch.overrides._get_current_function_mode_stack()
    return bool(stack) and stack[-1] is mode


def _with_autocast(device_type, dtype, fn, *args):
    with torch.autocast(device_type, dtype=dtype):
        return fn(*args)


# ---- hooks on the model -----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _labels_position(cls: type) -> int | None:
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("labels") - 1 if "labels" in params else None


def _labels(module, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"]
    i = _labels_position(type(module))
    return args[i] if i is not None and i < len(args) else None


def _open(module, args, kwargs) -> "_Window | None":
    """Arm the head for this call (module doc, 1.); None when the call is not eligible."""
    state: HeadState | None = module.__dict__.get(ATTR)
    if (state is None or not state.enabled or not module.training or getattr(_local, "keep", 0)
            or _labels(module, args, kwargs) is None or not torch.is_grad_enabled() or functorch_active()):
        return None
    if head_reason(module) is not None:
        return None
    head = module.get_output_embeddings()
    if torch.compiler.is_compiling():  # Dynamo traces the compiled head's tensor subclass, not a mode
        win = CompiledWindow(head)
        head.__dict__["forward"] = win.capture
        return win
    win = _Window(state, head)
    head.__dict__["forward"] = win.capture
    state.windows.append(win)
    return win


def _close(module, win: "_Window") -> None:
    """Close the window whatever happened in the forward (an exception, a KeyboardInterrupt): the
    head's own forward back, the mode off the stack, the window off the model's list."""
    if win.head.__dict__.get("forward") == win.capture:
        win.head.__dict__.pop("forward", None)
    if isinstance(win, CompiledWindow):
        return
    state: HeadState | None = module.__dict__.get(ATTR)
    if state is not None and win in state.windows:
        state.windows.remove(win)
    if win.entered:
        if _top_is(win):
            win.__exit__(None, None, None)
        else:  # another mode still above ours (entered inside forward, not left): remove ours only
            stack = torch.overrides._get_current_function_mode_stack()
            if win in stack:
                remove_mode(win)


class _HeadForward(ContextForward):
    """The model's ``forward`` (set on the instance; class and state_dict unchanged): the previous
    forward inside an armed window, closed in ``finally`` -- a forward hook pair would leak the
    window on a ``KeyboardInterrupt`` (torch runs always-called hooks after an ``Exception`` only;
    see :mod:`leanact.recompute.context_forward`, whose signature handling it shares).
    ``active = False`` makes it inert (left in a chain another library wrapped since)."""

    def __init__(self, module: nn.Module, previous=None):
        super().__init__(module, None, previous)
        self.active = True

    def __call__(self, *args, **kwargs):
        forward = self._forward()
        win = _open(self.module, args, kwargs) if self.active else None
        if win is None:
            return forward(*args, **kwargs)
        form = self._loss_form() if isinstance(win, CompiledWindow) else None
        try:
            if form is None:
                output = forward(*args, **kwargs)
            else:  # Dynamo would turn the model's own nn.CrossEntropyLoss() into a call we cannot see
                output = loss_outside(self.module, forward, args, kwargs, _labels_position(type(self.module)), form)
        finally:
            _close(self.module, win)
        if isinstance(win, CompiledWindow):
            return output if not win.made or output is None else _clean_compiled(win, output)
        if not win.entries or output is None:
            return output
        return _clean(win, output)


    def _loss_form(self) -> str | None:
        """The class's loss form read when patched, while the forward this wrapper calls is still the
        one read: the class's ``forward`` (not replaced on the class since), reached through leanact's
        pass-through wrappers only (a forward a user or another library set on the instance may do
        anything with ``labels``)."""
        state: HeadState = self.module.__dict__[ATTR]
        if state.loss_form is None or type(self.module).forward is not state.loss_form_of:
            return None
        f = self.previous
        for _ in range(8):
            if f is None:
                return state.loss_form
            if type(f) is not ContextForward:
                return None
            f = f.previous
        return None


def remove_mode(win) -> None:
    saved = []
    while True:
        top = torch._C._pop_torch_function_stack()
        if top is win:
            break
        saved.append(top)
    for m in reversed(saved):
        torch._C._push_on_torch_function_stack(m)


def _clean(win: _Window, output):
    def fix(v):
        e = win._entry(v)
        if e is None:
            return v, False
        if win.consumed and e.real is None:
            return None, True
        return win.materialise(e), False

    return _cleaned(output, fix)


def _clean_compiled(win: CompiledWindow, output):
    """As :func:`_clean` for a compiled call: ``logits`` None when the loss was fused (and nothing
    else used them), the real logits as a plain tensor otherwise."""
    def fix(v):
        if not isinstance(v, LazyLogits):
            return v, False
        if win.consumed and not win.unfused:
            return None, True
        with torch._C.DisableTorchFunctionSubclass():
            return v.view_as(v), False

    return _cleaned(output, fix)


def _cleaned(output, fix):
    """``output`` with each field replaced by ``fix(field)`` -> (value, drop): a dropped field is
    removed (a ModelOutput then reads None; a tuple is one shorter)."""
    if isinstance(output, OrderedDict):  # a transformers ModelOutput
        for k in list(output.keys()):
            new, drop = fix(output[k])
            if drop:
                OrderedDict.__delitem__(output, k)
                object.__setattr__(output, k, None)
            elif new is not output[k]:
                output[k] = new
        return output
    if isinstance(output, tuple):
        items = []
        for v in output:
            new, drop = fix(v)
            if not drop:
                items.append(new)
        return type(output)(items) if type(output) is tuple else output
    return output


def install(model: nn.Module, path: str, enabled: bool = True) -> HeadState:
    """Wrap ``model.forward`` (an eligible Hugging Face model) and attach its state."""
    state = HeadState(path, enabled, loss_form=loss_form(type(model)), loss_form_of=type(model).forward)
    model.__dict__[ATTR] = state
    model.__dict__["forward"] = _HeadForward(model, model.__dict__.get("forward"))
    _name_loss_type(model, state)
    return state


def _name_loss_type(model: nn.Module, state: HeadState) -> None:
    """Set ``model.loss_type = "ForCausalLM"`` where Hugging Face's ``loss_function`` would fall back to
    that loss after a warning (``loss_type`` None or unknown: GPT-2, GPT-J, ...): the same loss function,
    without the warning, which ``torch.compile`` cannot trace (a graph break of the unpatched model's
    own, around the head). The previous value is restored by :func:`uninstall`."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover
        return
    if "ForCausalLM" not in LOSS_MAPPING or "_loss_function" in model.__dict__:
        return
    had = "loss_type" in model.__dict__
    before = model.__dict__.get("loss_type")
    if had and isinstance(before, str) and before in LOSS_MAPPING:
        return
    if not had and getattr(model, "loss_type", None) in LOSS_MAPPING:
        return
    state.loss_type_was = (had, before)
    model.loss_type = "ForCausalLM"


def _restore_loss_type(m: nn.Module, state: HeadState) -> None:
    if state.loss_type_was is None or m.__dict__.get("loss_type") != "ForCausalLM":
        return  # never set, or set since by the user: theirs stays
    had, before = state.loss_type_was
    if had:
        m.__dict__["loss_type"] = before
    else:
        del m.__dict__["loss_type"]


def uninstall(model: nn.Module) -> None:
    """Remove the wrapper and state from every module of ``model`` (copies included: found by type;
    a wrapper that another library wrapped since is made inert)."""
    for m in model.modules():
        state = m.__dict__.pop(ATTR, None)
        if state is None:
            continue
        _restore_loss_type(m, state)
        wrapper = m.__dict__.get("forward")
        if isinstance(wrapper, _HeadForward):
            if wrapper.previous is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = wrapper.previous
            continue
        for f in _chain(wrapper):
            if isinstance(f, _HeadForward):
                f.active = False


def _chain(f, depth: int = 8):
    """The forwards wrapped inside ``f`` (attributes ``previous``, ``__wrapped__``), outermost first."""
    for _ in range(depth):
        if f is None:
            return
        yield f
        f = getattr(f, "previous", None) or getattr(f, "__wrapped__", None)


def _install(model: nn.Module, run: PatchRun) -> None:
    """Install the fused loss on the outermost Hugging Face language models of ``model``."""
    inside: list[nn.Module] = []
    for path, m in model.named_modules():
        if not eligible_class(m) or any(any(c is m for c in o.modules()) for o in inside):
            continue
        inside.append(m)
        head = m.get_output_embeddings()
        head_name = next((n for n, c in m.named_modules() if c is head), "?") if head is not None else "-"
        before = f"{head_name} ({type(head).__name__}) + cross_entropy"
        reason = head_reason(m) if run.fused_loss else "fused_loss=False"
        if reason is not None:
            run.summary.loss.append((path, before, f"left: {reason}"))
            continue
        run.summary.loss_states[path] = install(m, path)
        run.summary.loss.append((path, before, "leanact fused linear + cross-entropy (training with labels; "
                                               "logits None)"))


STEP = ModelStep("fused_loss", _install, lambda model, run: uninstall(model))
