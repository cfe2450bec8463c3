"""The hand-off of a tied weight's gradient from a language-model head to its embedding.

A tied model (Llama 3.2 1B/3B, Gemma, GPT-2, BERT's MLM head, T5) uses one weight W (V × H) twice:
the embedding reads rows of it, the head multiplies by it. Autograd gives W's leaf both gradients
and adds them: the head's dense dW (V·H elements, computed first, at the top of the backward) waits
in W's input buffer until the embedding's backward, which makes a second dense V × H tensor (zeros
plus the token rows) before the two are added -- under a tracker or another ``TorchDispatchMode``
into a third. With a fused head the step's peak is often there, at the end of the backward.

:func:`hand_off` lets a head that computed dW give it to the embedding's node instead of returning
it: the embedding (:class:`~leanact.ops.embedding.function.TiedEmbeddingFunction`) then adds its
token rows into that tensor and returns it, the whole gradient, once. No second V × H tensor is made;
every sum is the same (the head's dW plus the embedding's rows, the buffer's order), so W's gradient
is the one autograd would have made.

The head keeps dW (returns None for W) only where nothing the user can do could lose it:

* the backward builds no graph (``create_graph=False``) and is autograd's engine's, not compiled
  autograd's;
* a live embedding node's weight edge is the head's weight edge (the same node and input: W's
  ``AccumulateGrad``, or one cast both read), so what reaches W is the same sum;
* the engine will run that node in this backward (``torch._C._will_engine_execute_node``:
  ``backward(inputs=...)`` and ``autograd.grad`` included) and it has not run yet in it: it runs
  later and takes what was handed to it (keyed by the graph task, so a backward that raised leaves
  nothing a later one could take).

What is visible differently: a hook on the head's own node (``grad_fn.register_hook``, leanact's
internal Function) sees None for W. Hooks on W (``register_hook``, post-accumulate hooks: DDP, FSDP,
optimizer-in-backward) see the same gradient as before.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch

__all__ = ["register_embedding", "receiver", "give", "hand_off", "take", "handed_off"]

_lock = threading.Lock()
#: weak references to the embedding nodes (TiedEmbeddingFunction ctx) whose graphs are alive
_NODES: list[weakref.ref] = []
_STATS = {"handed_off": 0}


def register_embedding(ctx) -> None:
    """Called by the embedding's forward: its node may receive a head's dW."""
    with _lock:
        _NODES[:] = [r for r in _NODES if r() is not None]
        _NODES.append(weakref.ref(ctx))
    ctx.leanact_handed = []  # (graph task id, dW) given to this node
    ctx.leanact_ran_in = None  # the graph task the node's backward last ran in


def _compiled_autograd() -> bool:
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    fn = getattr(ca, "in_compiled_autograd_region", None) if ca is not None else None
    if callable(fn):
        return bool(fn())
    return bool(getattr(ca, "compiled_autograd_enabled", False)) if ca is not None else False


def _same_edge(a, b) -> bool:
    return a[0] is not None and a[0] is b[0] and a[1] == b[1]


def receiver(ctx, index: int):
    """The embedding node that may take the gradient of input ``index`` of the head whose node is
    ``ctx`` in the backward running now, else None (module doc)."""
    if not _NODES or torch.is_grad_enabled() or _compiled_autograd():
        return None
    edge = ctx.next_functions[index]
    if edge[0] is None:
        return None
    task = torch._C._current_graph_task_id()
    with _lock:
        nodes = [n for n in (r() for r in _NODES) if n is not None]
    for node in nodes:
        if (getattr(node, "leanact_ran_in", task) != task and _same_edge(node.next_functions[0], edge)
                and torch._C._will_engine_execute_node(node)):
            return node
    return None


def give(node, grad) -> None:
    """Hand ``grad`` to the embedding ``node`` (:func:`receiver`): a tensor of the weight's shape, or a
    callable that computes it there (a head that computes its dW late: none of it exists before)."""
    node.leanact_handed.append((torch._C._current_graph_task_id(), grad))
    _STATS["handed_off"] += 1


def hand_off(ctx, index: int, grad: torch.Tensor | None) -> torch.Tensor | None:
    """``grad`` (the gradient of input ``index`` of the head whose node is ``ctx``), or None where an
    embedding node reading the same weight takes it (module doc)."""
    if grad is None or grad.layout != torch.strided:
        return grad
    node = receiver(ctx, index)
    if node is None or tuple(grad.shape) != tuple(node.leanact_weight_shape) or grad.dtype != node.leanact_weight_dtype:
        return grad
    give(node, grad)
    return None


def take(ctx) -> list:
    """In the embedding node's backward: what heads handed to it in this backward, tensors or callables
    (and marks it run)."""
    task = torch._C._current_graph_task_id()
    ctx.leanact_ran_in = task
    handed = getattr(ctx, "leanact_handed", None)
    if not handed:
        return []
    mine = [g for t, g in handed if t == task]
    handed[:] = [(t, g) for t, g in handed if t != task]  # (another task's: freed with the node)
    return mine


def handed_off() -> int:
    """How many head gradients have been handed to an embedding in this process (tests, benchmarks)."""
    return _STATS["handed_off"]
