"""The measured counterpart of :func:`leanact.estimate`: one real step under ``MemTracker``."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from leanact.strategies.cache import caches_off

from .result import Estimate

__all__ = ["measure"]


def measure(model: nn.Module, inputs: Any, strategy_or_plan: Any = None, *, optimizer: Any = "adamw",
            loss_fn: Callable | None = None, copy_model: bool = True,
            warmup: bool = True, autocast: Any = None,
            keep_output: bool = False) -> Estimate:
    """Run one real training step (real tensors, CPU) with the estimator's protocol and return
    the measured numbers in an :class:`Estimate`. ``copy_model``: step on a deep copy so the
    model's weights are not updated. ``warmup``: one untracked forward + backward first, so
    per-process caches built lazily on first use (leanact's CPU dropout index ranges) are not
    counted in the step. ``autocast``: as for :func:`leanact.estimate` (the forward under
    ``torch.autocast`` of the model's device). ``keep_output``: as in :func:`leanact.estimate` (default:
    the output is released before backward)."""
    from leanact.ops import fake_rules
    from leanact.ops.amp import autocast_arg

    from .api import _resolve_plan, _result
    from .fake import _copy_attention_state
    from .step import _call, default_loss, run_step

    autocast = autocast_arg(autocast, "measure")
    m = model
    if copy_model:
        m = copy.deepcopy(model)
        _copy_attention_state(model, m)
    m.train()
    fake_rules.prepare()
    plan = _resolve_plan(m, strategy_or_plan)
    if plan is not None:
        plan.apply(m)
    try:
        with caches_off(m, inputs) as inputs:  # as leanact.estimate does
            if warmup:  # one untracked forward + backward: lazily built caches exist before the measured step
                device_type = next((p.device.type for p in m.parameters()), "cpu")
                with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
                    loss = (loss_fn or default_loss)(_call(m, inputs), inputs)
                loss.backward()
                del loss
                m.zero_grad(set_to_none=True)
            mem = run_step(m, inputs, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast, keep_output=keep_output)
    finally:
        if plan is not None:
            plan.remove(m)
    p = next((p for p in m.parameters() if p.is_floating_point()), None)
    return _result(mem, m, "cpu", p.dtype if p is not None else torch.float32, ["measured (real tensors)"],
                   autocast)
