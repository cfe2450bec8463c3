"""The saved-activation meter: what autograd keeps between forward and backward.

Every tensor that autograd saves for backward passes through
``torch.autograd.graph.saved_tensors_hooks``; the meter records it there (storage identity,
bytes, shape, dtype, the innermost module running at that moment) and, after the forward, labels
each record with the autograd node that holds it by walking the graph. Storages are counted once
(a tensor kept by several ops, or several views of one buffer, cost one storage), and the
storages of parameters and buffers are excluded: they live whether or not backward happens.

Under ``torch.autocast`` a matmul of an fp32 weight keeps autocast's 16-bit cast of that weight:
a copy of the parameter, counted (it is kept for backward), but batch-independent. The meter
recognises such copies of the model's parameters and reports them apart
(:attr:`SavedTensorMeter.weight_copy_bytes`; :attr:`SavedRecord.weight_copy` names the parameter).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from leanact.saved import SavedTensorObserver, introspecting
from leanact.saved import release as _release

__all__ = ["SavedRecord", "SavedTensorMeter", "saved_bytes"]


@dataclass
class SavedRecord:
    """One tensor packed for backward."""

    index: int
    storage_key: int
    storage_nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    module: str
    op: str = "?"
    excluded: str | None = None  # "parameter" / "buffer" / "excluded" / "gradient" when not counted
    duplicate_of: int | None = None  # index of the record that already counted this storage
    weight_copy: str | None = None  # the parameter this is a 16-bit cast of (autocast's weight copy)

    @property
    def counted_bytes(self) -> int:
        """Bytes this record adds to the total (0 for excluded or already-counted storages)."""
        if self.excluded is not None or self.duplicate_of is not None:
            return 0
        return self.storage_nbytes


def _storage_key(t: torch.Tensor) -> int:
    # Identity of the StorageImpl: equal for all views of one buffer; works for meta/fake tensors.
    return t.untyped_storage()._cdata


_LOW = (torch.bfloat16, torch.float16)
_VIEW_NODES = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
               "ExpandBackward0", "AsStridedBackward0", "AliasBackward0", "SliceBackward0")


def _cast_source(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf ``t`` is a cast (``.to``) of, through views, by its autograd history (None: none)."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0] if node.next_functions else None
    if node is None or type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
        return None
    leaf = node.next_functions[0][0]
    return getattr(leaf, "variable", None)


def _equal_cast(base: torch.Tensor, p: torch.Tensor) -> bool:
    try:
        with torch.no_grad():
            return bool(torch.equal(base, p.to(base.dtype)))
    except Exception:  # fake or meta tensors: no values to compare
        return False


class SavedTensorMeter(SavedTensorObserver):
    """Context manager that records every tensor autograd saves during a forward pass.

    >>> meter = SavedTensorMeter(model)
    >>> with meter:
    ...     loss = model(x).sum()
    >>> meter.attribute(loss)          # optional: label records with autograd node names
    >>> meter.total_bytes, meter.by_module(), meter.by_op()

    ``model`` (one module or several) supplies module names and the parameters/buffers to exclude;
    ``exclude`` adds tensors whose storages are not counted (e.g. inputs you do not own). Any
    ``nn.Parameter`` (or view of one) is excluded even when no model is given, and so are gradients
    a fused op computed in its forward and keeps until backward scales them (the fused loss's dx,
    dW, db: every training step allocates them, unfused ones at the backward's start; their
    records say ``excluded="gradient"``, and ``leanact.estimate`` counts them in the step's peak).

    The meter is an observer of :mod:`leanact.saved`'s pipeline: when leanact replaces a tensor by
    something smaller (a recipe to recompute it, a compressed or offloaded copy), the meter counts
    what is really kept, whichever context was entered first.
    """

    def __init__(self, model: nn.Module | Iterable[nn.Module] | None = None, exclude: Iterable[torch.Tensor] = ()):
        modules = [] if model is None else ([model] if isinstance(model, nn.Module) else list(model))
        self._names: dict[int, str] = {}
        self._excluded: dict[int, str] = {}
        self._param_names: dict[int, str] = {}
        self._fp32_by_shape: dict[tuple, list[nn.Parameter]] = {}
        for root in modules:
            for name, mod in root.named_modules():
                self._names.setdefault(id(mod), name or type(mod).__name__)
            for name, p in root.named_parameters():
                self._param_names.setdefault(id(p), name)
                if p.dtype == torch.float32:
                    self._fp32_by_shape.setdefault(tuple(p.shape), []).append(p)
            for p in root.parameters():
                self._excluded[_storage_key(p)] = "parameter"
            for b in root.buffers():
                self._excluded[_storage_key(b)] = "buffer"
        for t in exclude:
            self._excluded[_storage_key(t)] = "excluded"
        self.records: list[SavedRecord] = []
        self._first_by_key: dict[int, int] = {}
        self._storage_refs: list = []  # weak references to the counted storages (see _forget_when_freed)
        self._stack: list[str] = []
        self._introspect_log: list[int] | None = None
        self._exit_stack: contextlib.ExitStack | None = None
        self._packed: list = []  # weak references to what the pipeline packed while active

    # -- hooks -----------------------------------------------------------------------------
    def _module_name(self, mod: nn.Module) -> str:
        return self._names.get(id(mod), type(mod).__name__)

    def _pre_hook(self, mod, args):
        parent = self._stack[-1] if self._stack else ""
        name = self._module_name(mod)
        if id(mod) not in self._names and parent:
            name = f"{parent}/{name}"
        self._stack.append(name)

    def _post_hook(self, mod, args, out):
        if self._stack:
            self._stack.pop()

    def _record(self, t: torch.Tensor) -> int:
        key = _storage_key(t)
        index = len(self.records)
        excluded = self._excluded.get(key)
        if excluded is None and (isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)):
            excluded = "parameter"
        if excluded is None and getattr(t, "_leanact_gradient", False):
            excluded = "gradient"  # computed in the forward by a fused op (every step allocates its gradients)
        rec = SavedRecord(
            index=index,
            storage_key=key,
            storage_nbytes=t.untyped_storage().nbytes(),
            shape=tuple(t.shape),
            dtype=t.dtype,
            device=str(t.device),
            module=self._stack[-1] if self._stack else "",
            excluded=excluded,
        )
        if excluded is None:
            first = self._first_by_key.setdefault(key, index)
            if first != index:
                rec.duplicate_of = first
            else:
                self._forget_when_freed(t, key, index)
                if t.dtype in _LOW:
                    rec.weight_copy = self._weight_copy_of(t)
        self.records.append(rec)
        return index

    def _forget_when_freed(self, t: torch.Tensor, key: int, index: int) -> None:
        """When the storage counted by record ``index`` is freed (a tensor saved, then released with its
        graph before the forward ends), its key is forgotten: a storage allocated later at the same
        address is another storage, not a duplicate of this one."""
        meter = weakref.ref(self)

        def forget(_, key=key, index=index):
            m = meter()
            if m is not None and m._first_by_key.get(key) == index:
                del m._first_by_key[key]

        try:
            self._storage_refs.append(weakref.ref(t.untyped_storage(), forget))
        except TypeError:  # a storage without weak references: its key stays (the earlier behaviour)
            pass

    def _weight_copy_of(self, t: torch.Tensor) -> str | None:
        """The name of the fp32 parameter whose 16-bit cast ``t`` is (or a view of), else None:
        by autograd history (the cast of a parameter that requires grad), else, for a tensor
        without history (the cast of a frozen parameter), by shape and value (real tensors only)."""
        src = _cast_source(t)
        if src is not None:
            if src.dtype == torch.float32 and (id(src) in self._param_names or isinstance(src, nn.Parameter)):
                return self._param_names.get(id(src), "parameter")
            return None
        if t.grad_fn is not None:
            return None
        base = t._base if t._base is not None else t
        for p in self._fp32_by_shape.get(tuple(base.shape), ()):
            if p.device == base.device and _equal_cast(base, p):
                return self._param_names[id(p)]
        return None

    def on_pack(self, original: torch.Tensor, kept: list[torch.Tensor]) -> list[int]:
        return [self._record(t) for t in kept]

    def _track(self, packed) -> None:
        self._packed.append(weakref.ref(packed))

    def release(self) -> int:
        """Free what the measured forward keeps for backward when no backward will run.

        A measured forward that is dropped is freed when its graph is (leanact's pipeline keeps an
        op's own output detached, so no reference cycle holds it); ``release()`` (after
        :meth:`attribute`, if used) frees what it keeps at once, also where the graph itself is
        still referenced; a later backward through that graph raises. Returns the number of saved
        tensors released."""
        n = _release(self._packed)
        self._packed.clear()
        return n

    def on_unpack(self, token: list[int]) -> None:
        if self._introspect_log is not None:
            self._introspect_log.extend(token)

    def __enter__(self) -> "SavedTensorMeter":
        stack = contextlib.ExitStack()
        stack.callback(nn.modules.module.register_module_forward_pre_hook(self._pre_hook).remove)
        stack.callback(nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True).remove)
        self._exit_stack = stack
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        assert self._exit_stack is not None
        self._exit_stack.close()
        self._exit_stack = None
        self._stack.clear()

    # -- attribution -----------------------------------------------------------------------
    def attribute(self, *outputs: Any) -> "SavedTensorMeter":
        """Label records with the autograd node that keeps them (walks the graph of ``outputs``).

        Must be called before backward frees the graph. Records not reachable stay ``"?"``.
        """
        roots = [t.grad_fn for t in _tensors_in(outputs) if t.grad_fn is not None]
        # id -> node, each node held: a node's Python object may be freed with its last reference
        # (torch 2.11 does) and its id reused by another node's, which would then pass for seen
        seen: dict[int, Any] = {}
        while roots:
            node = roots.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            label = _node_label(node)
            self._introspect_log = []
            try:
                with introspecting():
                    _touch_saved(node)
            finally:
                log, self._introspect_log = self._introspect_log, None
            for i in log:
                if 0 <= i < len(self.records) and self.records[i].op == "?":
                    self.records[i].op = label
            roots.extend(n for n, _ in node.next_functions if n is not None)
        return self

    # -- results ---------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes kept for backward: distinct storages, parameters and buffers excluded."""
        return sum(r.counted_bytes for r in self.records)

    @property
    def weight_copy_bytes(self) -> int:
        """Of :attr:`total_bytes`, the 16-bit copies of fp32 parameters kept under autocast
        (batch-independent; ``leanact.patch`` keeps none: it recasts in backward)."""
        return sum(r.counted_bytes for r in self.records if r.weight_copy is not None)

    @property
    def activation_bytes(self) -> int:
        """:attr:`total_bytes` without :attr:`weight_copy_bytes`."""
        return self.total_bytes - self.weight_copy_bytes

    def counted(self) -> list[SavedRecord]:
        return [r for r in self.records if r.counted_bytes]

    def by_module(self, depth: int | None = None) -> "OrderedDict[str, int]":
        """Counted bytes per module name (truncated to ``depth`` dotted components if given)."""
        out: OrderedDict[str, int] = OrderedDict()
        for r in self.counted():
            name = r.module
            if depth is not None and name:
                name = ".".join(name.split(".")[:depth])
            out[name] = out.get(name, 0) + r.counted_bytes
        return out

    def by_op(self) -> "OrderedDict[str, int]":
        """Counted bytes per autograd node label (call :meth:`attribute` first)."""
        out: OrderedDict[str, int] = OrderedDict()
        for r in self.counted():
            out[r.op] = out.get(r.op, 0) + r.counted_bytes
        return out

    def table(self, title: str = "Saved for backward"):
        """A rich Table with one row per counted storage (``print()`` shows it)."""
        from leanact._format import text_table

        tab = text_table(title=title)
        for col in ("module", "op", "shape", "dtype", "bytes"):
            tab.add_column(col, justify="right" if col == "bytes" else "left")
        for r in self.counted():
            op = r.op if r.weight_copy is None else f"{r.op} (copy of {r.weight_copy})"
            tab.add_row(r.module, op, "x".join(map(str, r.shape)), str(r.dtype).replace("torch.", ""),
                        f"{r.counted_bytes:,}")
        tab.add_row("total", "", "", "", f"{self.total_bytes:,}", style="bold")
        if self.weight_copy_bytes:
            tab.add_row("  of which autocast weight copies", "", "", "", f"{self.weight_copy_bytes:,}")
        return tab


def _tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
    elif hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors_in(obj.to_tuple())


def _node_label(node: Any) -> str:
    name = type(node).__name__ if not hasattr(node, "name") else node.name()
    for suffix in ("Backward0", "Backward1", "Backward"):
        if name.endswith(suffix):
            return name[: -len(suffix)] or name
    return name


def _touch_saved(node: Any) -> None:
    """Unpack every tensor ``node`` saved, so the unpack hook logs which records it holds."""
    if hasattr(node, "saved_tensors") and isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            node.saved_tensors
        except RuntimeError:
            pass
        return
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                getattr(node, attr)
            except RuntimeError:  # freed, or not a tensor
                pass


def saved_bytes(fn: Callable[[], Any], model: nn.Module | None = None, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd keeps for backward while running ``fn()`` (see :class:`SavedTensorMeter`)."""
    meter = SavedTensorMeter(model, exclude=exclude)
    with meter:
        out = fn()
    del out
    meter.release()  # the graph is discarded: free it now (see SavedTensorMeter.release)
    return meter.total_bytes
