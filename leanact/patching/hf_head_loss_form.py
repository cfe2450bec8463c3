"""Models whose loss is ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``, built in ``forward``.

BERT-style masked language models (BERT, RoBERTa, ...) build ``nn.CrossEntropyLoss()`` inside their
forward and call it on the logits. Dynamo rewrites that call into a direct ``F.cross_entropy`` node
without dispatching ``__torch_function__`` (its special case for ``nn.CrossEntropyLoss`` built in
compiled code), so the compiled head's :class:`~.hf_head_compiled.LazyLogits` never sees it and the
loss would run unfused, keeping the logits. For such a class, while compiling, the head's forward
wrapper calls the model without ``labels`` and takes the loss itself, with the same call on the
returned logits, which the compiled head fuses.

That is sound only where the model's loss is exactly that call, so the class's ``forward`` is read
(:func:`loss_form`, once per class, when patching) and must have this form, else the model keeps its
own loss; at each call the wrapper also checks that this is still the forward it calls (the class's
``forward`` not replaced since, no forward of anyone else's set on the instance):

- ``labels`` is read only in ``if labels is not None:``, ``labels.view(-1)`` and the optional move;
- the body of that ``if`` is ``labels = labels.to(X.device)`` (optional, RoBERTa), ``f =
  CrossEntropyLoss()`` (no arguments: mean over the labels other than -100, no weights, no
  smoothing), then ``loss = f(X.view(-1, self.config.vocab_size), labels.view(-1))``;
- ``X`` is assigned once, before; ``loss`` is assigned ``None`` before and nowhere else, and read only in
  the one ``return`` of the forward, a call with the keywords ``loss=loss`` and ``logits=X``.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap

import torch

__all__ = ["loss_form", "loss_outside"]


@functools.lru_cache(maxsize=None)
def loss_form(cls: type) -> str | None:
    """``"as_is"`` or ``"moved"`` (labels moved to the logits' device first) when ``cls.forward``
    computes its loss as this module's doc describes; None otherwise."""
    fn = inspect.unwrap(getattr(cls, "forward", None))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return _matches(tree.body[0], getattr(fn, "__globals__", {}))


def _names(node, ctx) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)]


def _is_view_flat(node, name: str) -> bool:
    """``name.view(-1)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "view"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == name and not node.keywords
            and len(node.args) == 1 and _is_minus_one(node.args[0]))


def _is_minus_one(node) -> bool:
    return ((isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
             and node.operand.value == 1)
            or (isinstance(node, ast.Constant) and node.value == -1))


def _is_vocab(node) -> bool:
    """``self.config.vocab_size``."""
    return (isinstance(node, ast.Attribute) and node.attr == "vocab_size"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "config"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self")


def _logits_arg(node) -> str | None:
    """``X`` of ``X.view(-1, self.config.vocab_size)``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "view"
            and isinstance(node.func.value, ast.Name) and not node.keywords and len(node.args) == 2
            and _is_minus_one(node.args[0]) and _is_vocab(node.args[1])):
        return node.func.value.id
    return None


def _resolve(dotted: str, scope: dict):
    parts = dotted.split(".")
    obj = scope.get(parts[0], getattr(builtins, parts[0], None))
    for p in parts[1:]:
        obj = getattr(obj, p, None)
    return obj


def _matches(fn: ast.FunctionDef, scope: dict) -> str | None:
    if "labels" not in [a.arg for a in fn.args.args + fn.args.kwonlyargs]:
        return None
    ifs = [s for s in ast.walk(fn) if isinstance(s, ast.If) and _is_labels_not_none(s.test)]
    if len(ifs) != 1 or ifs[0].orelse or len(ifs[0].body) not in (2, 3):
        return None
    body = ifs[0].body
    moved = len(body) == 3  # RoBERTa: ``labels = labels.to(X.device)`` first
    reads = [n for n in _names(fn, ast.Load) if n.id == "labels"]
    if len(reads) != 2 + moved or sum(n.id == "labels" for n in _names(fn, ast.Store)) != moved:
        return None
    make, call = body[-2:]
    if not (isinstance(make, ast.Assign) and len(make.targets) == 1 and isinstance(make.targets[0], ast.Name)
            and isinstance(make.value, ast.Call) and not make.value.args and not make.value.keywords
            and _resolve(_dotted(make.value.func), scope) is torch.nn.CrossEntropyLoss):
        return None
    f = make.targets[0].id
    if not (isinstance(call, ast.Assign) and len(call.targets) == 1 and isinstance(call.targets[0], ast.Name)
            and isinstance(call.value, ast.Call) and isinstance(call.value.func, ast.Name) and call.value.func.id == f
            and not call.value.keywords and len(call.value.args) == 2 and _is_view_flat(call.value.args[1], "labels")):
        return None
    loss, x = call.targets[0].id, _logits_arg(call.value.args[0])
    if x is None or len({f, loss, x, "labels"}) != 4 or (moved and not _is_move(body[0], x)):
        return None
    stores = _names(fn, ast.Store)
    if sum(n.id == x for n in stores) != 1 or sum(n.id == f for n in stores) != 1:
        return None
    loss_sets = [s for s in ast.walk(fn) if isinstance(s, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == loss for t in s.targets)]
    if (len(loss_sets) != 2 or loss_sets[1] is not call or len(loss_sets[0].targets) != 1
            or not (isinstance(loss_sets[0].value, ast.Constant) and loss_sets[0].value.value is None)
            or sum(n.id == loss for n in stores) != 2
            or any(isinstance(s, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) for s in ast.walk(fn))):
        return None
    returns = [s for s in ast.walk(fn) if isinstance(s, ast.Return)]
    if len(returns) != 1 or not isinstance(returns[0].value, ast.Call):
        return None
    kw = {k.arg: k.value for k in returns[0].value.keywords}
    if not (isinstance(kw.get("loss"), ast.Name) and kw["loss"].id == loss
            and isinstance(kw.get("logits"), ast.Name) and kw["logits"].id == x):
        return None
    loss_reads = [n for n in _names(fn, ast.Load) if n.id == loss]
    if len(loss_reads) != 1 or loss_reads[0] is not kw["loss"]:
        return None
    return "moved" if moved else "as_is"


def _is_move(stmt, x: str) -> bool:
    """``labels = labels.to(x.device)``."""
    v = stmt.value if isinstance(stmt, ast.Assign) else None
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == "labels" and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
            and v.func.attr == "to" and isinstance(v.func.value, ast.Name) and v.func.value.id == "labels"
            and not v.keywords and len(v.args) == 1 and isinstance(v.args[0], ast.Attribute)
            and v.args[0].attr == "device" and isinstance(v.args[0].value, ast.Name) and v.args[0].value.id == x)


def _is_labels_not_none(test) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "labels"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def loss_outside(module, forward, args, kwargs, position: int | None, form: str):
    """``forward(*args, **kwargs)`` as the model's own call with labels, its loss taken here: the call
    without labels, then ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))`` on its logits (a
    ModelOutput: the same class with ``loss`` set; a tuple (``return_dict=False``): the loss first)."""
    if "labels" in kwargs:
        labels = kwargs["labels"]
        kwargs = {**kwargs, "labels": None}
    else:
        labels = args[position]
        args = args[:position] + (None,) + args[position + 1:]
    output = forward(*args, **kwargs)
    if isinstance(output, tuple):
        logits = output[0]
    else:
        logits = output["logits"]
    if form == "moved":
        labels = labels.to(logits.device)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, module.config.vocab_size), labels.view(-1))
    if isinstance(output, tuple):
        return (loss,) + output
    return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
