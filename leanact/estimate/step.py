"""One training step under torch's ``MemTracker`` -- the same protocol for the prediction (fake
tensors) and for the measurement (real tensors), so the two are comparable number for number.

Protocol (a steady-state step): the optimizer state already exists (it is created beforehand by
one step on zero gradients), gradients are None; then forward (+ loss) with the saved-tensor
meter on, the model output released (the Trainer protocol: Hugging Face's ``Trainer`` and most
loops keep only the loss; ``keep_output=True`` holds the output -- the logits -- through backward,
as a loop that logs them does), backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``. The peak is the
largest total the tracker saw: parameters + buffers + optimizer state + activations + gradients +
temporaries (+ the inputs, "other").
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _UpdateType, _WeakRefInfo
from torch.distributed._tools.common_utils import get_untyped_storages

from leanact.memory import SavedTensorMeter
from leanact.strategies.offload import allocating_host, is_host_copy_key

__all__ = ["RoundingMemTracker", "StepMemory", "make_optimizer", "run_step", "default_loss"]

_DEVICE = torch.ops.prim.device.default
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


class RoundingMemTracker(MemTracker):
    """``MemTracker`` that rounds every storage up to ``block`` bytes whatever its device (``block``
    = 512 predicts CUDA's ``max_memory_allocated`` from a CPU run; 1 = exact bytes), and counts
    the host buffers of offload pools (:mod:`leanact.strategies.offload`) apart from every device:
    ``host_peak`` (with ``block`` > 1, i.e. CUDA, each rounded up to a power of two as PyTorch's
    pinned-memory allocator does)."""

    host_now = 0
    host_peak = 0

    def _track(self, reftype, t) -> None:
        sts = get_untyped_storages(t)
        if not allocating_host() and not any(self._WINFO.get(st) is None and is_host_copy_key(st._cdata) for st in sts):
            return super()._track(reftype, t)
        for st in sts:  # a host buffer being allocated, or one reused from its pool: counted apart
            if self._WINFO.get(st) is None:
                winfo, w_st = _WeakRefInfo.create_winfo(st, t.device, reftype, self._delete_callback)
                winfo.leanact_host = True
                self._WINFO[st] = (winfo, w_st)
                self._update_snap(_UpdateType.ADD, winfo)

    def __init__(self, block: int = 1):
        super().__init__()
        self.block = block

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        """As ``MemTracker``'s, and a model called again at the top level within the step (a trainer's
        second forward, KTO's KL term) is tracked on: its module statistics keep the first call's."""
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            if module not in self.memory_tracking:
                raise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a tensor's device (asked by C++ code: autograd, foreach): nothing to track
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        if getattr(winfo, "leanact_host", False):
            raw = winfo.size * winfo.element_size
            n = 1 << max(0, raw - 1).bit_length() if self.block > 1 and raw else raw
            if u_type == _UpdateType.ADD:
                winfo.mem_consumed = n
                self.host_now += n
                self.host_peak = max(self.host_peak, self.host_now)
            elif u_type == _UpdateType.DEL:
                self.host_now -= winfo.mem_consumed
            return
        if self.block > 1 and u_type in (_UpdateType.ADD, _UpdateType.SIZE):
            raw = winfo.size * winfo.element_size
            winfo.mem_consumed = math.ceil(raw / self.block) * self.block
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # torch's version hooks every parameter's gradient, and a frozen one (PEFT's base weights)
        # refuses a hook: hook the trainable ones only.
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for p in module.parameters():
                if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (p.register_hook(self._track_grad),
                                                           p.register_post_accumulate_grad_hook(self._track_param_grad))
        return sizes

    def _track_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _track_param_grad(self, p: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state) -> None:
        # Only the global peak: torch's version also updates every active module's local peak
        # after every op (half the run time on big models), which the estimate does not use.
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)


def make_optimizer(optimizer: Any, params: list[nn.Parameter], *, foreach: bool | None = None):
    """``"adamw"`` (lr 1e-3), ``"sgd"`` (momentum 0.9: one buffer per parameter), None, an
    ``Optimizer`` class or a callable ``params -> Optimizer``."""
    if optimizer is None:
        return None
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if callable(optimizer):
        return optimizer(params)
    raise ValueError(f"optimizer must be 'adamw', 'sgd', None or a callable params -> Optimizer, got {optimizer!r}")


def default_loss(out: Any, inputs: Any) -> torch.Tensor:
    """The model's own loss (``out.loss``, e.g. Hugging Face with labels) or a scalar output."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if (loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor)
            and out[0].dim() == 0):
        loss = out[0]
    if loss is None:
        raise ValueError(
            f"cannot find a loss in the model output ({type(out).__name__}): pass labels in sample_inputs "
            "(Hugging Face models then return .loss) or loss_fn=lambda out, inputs: <scalar tensor>")
    return loss


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _total(snap: dict) -> dict[str, int]:
    """Sum a tracker snapshot over devices: {category value or 'Total': bytes}."""
    out: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            key = k.value if hasattr(k, "value") else str(k)
            out[key] = out.get(key, 0) + v
    return out


@dataclass
class StepMemory:
    """What one tracked step gave (bytes)."""

    peak: int
    at_peak: dict[str, int]  # tracker categories at the peak moment
    after_forward: dict[str, int]
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    saved: int  # kept for backward (meter: distinct storages, parameters excluded)
    saved_by_module: dict[str, int]
    weight_copies: int = 0  # of saved: autocast's 16-bit copies of fp32 parameters
    alive_by_module: dict[str, int] = field(default_factory=dict)  # activation growth over each module's forward
    host: int = 0  # peak of the offload pools' host buffers (pinned host memory on CUDA)


def _init_optimizer(opt, params: list[nn.Parameter], optimizer: Any = None) -> None:
    """The optimizer's state as after a first step. For the built-in ``"adamw"`` it is made directly,
    as ``torch.optim.AdamW`` makes it (a CPU float32 ``step``, ``exp_avg`` and ``exp_avg_sq`` like the
    parameter: no capturable, fused or amsgrad there); any other optimizer takes a step on zero
    gradients."""
    if optimizer == "adamw" and type(opt) is torch.optim.AdamW and not any(
            g["amsgrad"] or g["capturable"] or g["fused"] or g["differentiable"] for g in opt.param_groups):
        for p in params:
            opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.get_default_dtype() if torch.get_default_dtype()
                                                 == torch.float64 else torch.float32),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_step(model: nn.Module, inputs: Any, *, optimizer: Any = "adamw", loss_fn: Callable | None = None,
             block: int = 1, foreach: bool | None = None, autocast: torch.dtype | None = None,
             keep_output: bool = False, forward: Callable[[nn.Module, Any], Any] | None = None,
             externals: tuple[nn.Module, ...] = ()) -> StepMemory:
    """Run one training step of ``model`` on ``inputs`` (real or fake tensors) under the tracker.
    ``autocast``: run the forward and the loss under ``torch.autocast`` of that dtype, for the
    device of the model's parameters (backward and the optimizer step outside it, as usual); None:
    the forward runs with autocast off, even when the call is inside ``torch.autocast``.
    ``keep_output``: hold the model output through backward (default: released before it).
    ``forward(model, inputs)``: what the forward runs (default: ``model(**inputs)``); ``externals``:
    other modules it uses (a reference model), whose weights count as parameters, not as made."""
    loss_fn = loss_fn or default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, foreach=foreach)
    if opt is not None:
        _init_optimizer(opt, params, optimizer)
    for p in params:
        p.grad = None
    tracker = RoundingMemTracker(block)
    tracker.track_external(model, *externals, *_tensors(inputs), *([opt] if opt is not None else []))
    start = _total(tracker.get_tracker_snapshot())
    meter = SavedTensorMeter(model, exclude=_tensors(inputs))
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    amp = torch.autocast(device_type, dtype=autocast, enabled=autocast is not None)  # None: off, even inside one
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")
        with tracker:
            with meter, amp:
                out = (forward or _call)(model, inputs)
                loss = loss_fn(out, inputs)
            if not keep_output:
                del out
            after_forward = _total(tracker.get_tracker_snapshot())
            loss.backward()
            del loss
            if keep_output:
                del out
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                for p in params:
                    p.grad = None
    peak, host = _total(tracker.get_tracker_snapshot("peak")), tracker.host_peak
    grads = sum(_nbytes(p, block) for p in params)
    opt_bytes = start.get(_MemRefType.OPT.value, 0)
    return StepMemory(
        peak=peak.get("Total", 0), at_peak=peak, after_forward=after_forward,
        params=start.get(_MemRefType.PARAM.value, 0), buffers=start.get(_MemRefType.BUFFER.value, 0),
        grads=grads, optimizer_state=opt_bytes, saved=meter.total_bytes,
        saved_by_module=dict(meter.by_module()), alive_by_module=_alive_by_module(tracker),
        weight_copies=meter.weight_copy_bytes, host=host)


def _nbytes(t: torch.Tensor, block: int) -> int:
    n = t.untyped_storage().nbytes() if t.untyped_storage().nbytes() else t.numel() * t.element_size()
    return math.ceil(n / block) * block


def _alive_by_module(tracker: MemTracker) -> dict[str, int]:
    """Per module: activation bytes alive after its forward minus before it (what it left alive)."""
    out: dict[str, int] = {}
    for stats in tracker.memory_tracking.values():
        pre, post = stats.snapshots.get(_ModState.PRE_FW), stats.snapshots.get(_ModState.POST_FW)
        if not pre or not post:
            continue
        act = _MemRefType.ACT.value
        name = stats.mod_fqn.split(".", 1)[1] if "." in stats.mod_fqn else ""  # drop the root's class name
        out[name] = _total(post[0]).get(act, 0) - _total(pre[0]).get(act, 0)
    return out
