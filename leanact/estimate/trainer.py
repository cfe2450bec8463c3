"""One step of a Hugging Face ``Trainer`` (TRL's SFT, DPO, KTO, GRPO, RLOO trainers included): the
trainer's own ``compute_loss`` with every model it holds (the policy, a reference model), backward
and the optimizer's step -- predicted on fake tensors (:func:`estimate_trainer`) or measured on real
ones with the same protocol (:func:`measure_trainer`)."""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from .api import _device_kind, _dtype_arg, _dtype_of, _result, _run
from .fake import DATA_DEPENDENT, fake_copy, fake_inputs, new_mode
from .result import Estimate

__all__ = ["estimate_trainer", "measure_trainer", "trainer_optimizer"]

_NOTE = ("a trainer step: trainer.compute_loss (every model the trainer holds: the reference's forward is "
         "counted where the trainer runs it), backward, the optimizer's step; values the trainer reads on the host "
         "from floating-point results (its logged metrics) are taken as 0 on fake tensors")
_TRL_CUDA_NOTE = ("TRL's fused LM head: on fake tensors its torch fallback runs with its per-tile folds made "
                  "allocation-free, as its Triton kernels are on a GPU (which also score only the positions "
                  "with labels: a copy of their hidden states, not counted), and its fp32 accumulation of the "
                  "gradient products without upcast copies, as addmm with out_dtype does on CUDA")


class HostReads(TorchDispatchMode):
    """Inside a fake trace: ``.item()`` of a fake floating-point or bool tensor (a trainer's metrics:
    ``loss.item()``, ``rewards.mean().item()``, ``if total > 0``) gives 0.0 / False instead of failing:
    such values are logged, not used to size tensors; a selection by a mask of fake values
    (``logps[~logps.isnan()]``) takes every position, an upper bound. A read of a fake integer still
    fails (integers size tensors: the trainer's integer inputs stay real, :class:`~.fake.RealIntegerOps`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            if args[0].dtype == torch.bool:
                return False
            if args[0].is_floating_point():
                return 0.0
        if func is torch.ops.aten.nonzero.default and is_fake(args[0]):  # every position: an upper bound
            return torch.zeros((args[0].numel(), args[0].dim()), dtype=torch.long, device=args[0].device)
        if func is torch.ops.aten.index.Tensor and any(_fake_mask(i) for i in args[1]):
            indices = []
            for i in args[1]:
                if _fake_mask(i):
                    indices.extend([torch.zeros(i.numel(), dtype=torch.long, device=i.device)] * i.dim())
                else:
                    indices.append(i)
            return func(args[0], indices, *args[2:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _fake_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool and is_fake(t)


def _held_models(trainer) -> dict[str, nn.Module]:
    """``{"model": the trained model, name: every other module the trainer holds}`` (TRL's
    ``ref_model``; a teacher)."""
    model = getattr(trainer, "model", None)
    if not isinstance(model, nn.Module) or not callable(getattr(trainer, "compute_loss", None)):
        raise TypeError("estimate_trainer takes a transformers.Trainer (or a TRL trainer), got "
                        f"{type(trainer).__name__}")
    wrapped = getattr(trainer, "model_wrapped", model)
    if wrapped is not model:
        raise ValueError(f"estimate_trainer: the trainer's model is wrapped ({type(wrapped).__name__}: DDP, FSDP or "
                         "DeepSpeed); estimate a single process's step before the trainer wraps it, or one rank's "
                         "step with leanact.estimate")
    held = {"model": model}
    for name, value in vars(trainer).items():
        if isinstance(value, nn.Module) and value is not model and name not in ("model", "model_wrapped"):
            held[name] = value
    return held


@contextlib.contextmanager
def _swapped(trainer, models: dict[str, nn.Module]) -> Iterator[None]:
    """The trainer holds ``models`` (and ``model_wrapped`` the new model) for the block; restored on
    exit, on an error or Ctrl-C too."""
    names = [*models, "model_wrapped"]
    old = {name: trainer.__dict__[name] for name in names if name in trainer.__dict__}
    try:
        for name, m in models.items():
            setattr(trainer, name, m)
        trainer.model_wrapped = models["model"]
        yield
    finally:
        for name in names:
            if name in old:
                setattr(trainer, name, old[name])
            else:
                trainer.__dict__.pop(name, None)


def first_batch(trainer) -> Any:
    """The first batch of the trainer's train dataloader, as ``compute_loss`` receives it
    (``trainer._prepare_inputs``: for GRPO and RLOO that generates completions with the real model)."""
    with _as_in_training(trainer):
        return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


@contextlib.contextmanager
def _as_in_training(trainer) -> Iterator[None]:
    """What ``Trainer.train`` sets before a step and TRL's steps read
    (``current_gradient_accumulation_steps``), set for the block where missing, removed after."""
    name = "current_gradient_accumulation_steps"
    missing = name not in trainer.__dict__
    if missing:
        setattr(trainer, name, trainer.args.gradient_accumulation_steps)
    try:
        yield
    finally:
        if missing:
            trainer.__dict__.pop(name, None)


def _checkpointing_as_in_train(trainer, model: nn.Module) -> None:
    """Turn on ``model``'s gradient checkpointing where ``trainer.train()`` would (TRL's configs turn it
    on by default): ``args.activation_checkpointing`` (``gradient_checkpointing`` before transformers
    5.x renamed it) with its keyword arguments."""
    args = trainer.args
    on = getattr(args, "activation_checkpointing", None)
    if on is None:
        on = getattr(args, "gradient_checkpointing", False)
    if not on:
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if hasattr(model, "activation_checkpointing_enable"):
        every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                              offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _compute_loss(trainer):
    def forward(model: nn.Module, inputs: Any) -> torch.Tensor:
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(model, inputs)
    return forward


def _returned(out: Any, inputs: Any) -> torch.Tensor:
    return out


@contextlib.contextmanager
def _trl_head_as_on_gpu() -> Iterator[None]:
    """TRL's fused head (``trl.kernels.chunked_logprob``) with its per-tile torch folds replaced by
    allocation-free ones, as its Triton kernels are on a GPU, and its fp32 ``acc += a @ b`` too where
    CUDA does it with ``addmm(out_dtype=float32)`` (no fp32 copies of a and b; values do not matter on
    fake tensors)."""
    try:
        from trl.kernels import chunked_logprob as head
    except ImportError:
        yield
        return
    names = ("_forward_tile", "_backward_tile") + (("_addmm_fp32",) if getattr(head, "_MM_OUT_DTYPE", False) else ())
    saved = {name: getattr(head, name) for name in names if hasattr(head, name)}
    try:
        for name, fn in saved.items():  # (wrapped: their signatures stay TRL's, which leanact's head checks)
            setattr(head, name, functools.wraps(fn)(lambda *args, **kwargs: None))
        yield
    finally:
        for name, fn in saved.items():
            setattr(head, name, fn)


@contextlib.contextmanager
def _around(kind: str) -> Iterator[None]:
    with (_trl_head_as_on_gpu() if kind == "cuda" else contextlib.nullcontext()), HostReads():
        yield


def trainer_optimizer(trainer) -> Any:
    """``params -> optimizer``: the optimizer ``trainer`` steps with -- the one it holds, else the class and
    arguments ``trainer.create_optimizer`` would use (``args.optim``: ``adamw_torch_fused`` by default, a
    fused AdamW whose step makes no temporaries of the parameters' size)."""
    held = getattr(trainer, "optimizer", None)
    while isinstance(getattr(held, "optimizer", None), torch.optim.Optimizer):  # (Accelerate's wrapper)
        held = held.optimizer
    if held is not None and _takes(type(held), held.defaults):
        cls, kwargs = type(held), dict(held.defaults)
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, getattr(trainer, "model", None))
    return functools.partial(_optimizer, cls, kwargs)


def _takes(cls: type, kwargs: dict) -> bool:
    """Whether ``cls(params, **kwargs)`` binds (an optimizer's ``defaults`` are usually its arguments)."""
    try:
        inspect.signature(cls).bind(None, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def _optimizer(cls, kwargs, params):
    return cls(params, **kwargs)


def _optimizer_arg(trainer, optimizer: Any) -> Any:
    return trainer_optimizer(trainer) if optimizer == "trainer" else optimizer


def estimate_trainer(trainer, inputs: Any = None, device: Any = None, *, dtype: Any = None,
                     optimizer: Any = "trainer") -> Estimate:
    """Predict the memory of one step of ``trainer`` (a ``transformers.Trainer``, TRL's included)
    without running it: ``trainer.compute_loss`` on ``inputs``, backward, then ``optimizer``'s step
    (``"trainer"``: the trainer's own, :func:`trainer_optimizer`; or as :func:`leanact.estimate` takes
    it), on fake copies of every model the trainer holds -- its ``model``
    and any other module attribute, such as a DPO or GRPO ``ref_model`` (whose weights count as
    parameters; its forward's memory where the trainer runs it). The trainer is left as it was.

    ``inputs``: the batch ``compute_loss`` receives (what ``trainer._prepare_inputs`` returns);
    default the first batch of the trainer's train dataloader, prepared -- for GRPO and RLOO that
    generates completions with the real model, and the reference's log-probabilities are computed
    there (not in this step). Integer inputs stay real (trainers read them); floating ones are fake.
    ``device``: "cuda" predicts a GPU step (:data:`leanact.estimate.CUDA_NOTES`); ``dtype`` casts the
    models' weights. Gradient checkpointing is on where ``trainer.train()`` turns it on (TRL's
    configs do by default); TRL's fused head and ``leanact.patch`` are traced as they run. A trainer
    whose model is already wrapped (DDP, FSDP, DeepSpeed) is refused.
    """
    held = _held_models(trainer)
    optimizer = _optimizer_arg(trainer, optimizer)
    if inputs is None:
        inputs = first_batch(trainer)
    dtype = _dtype_arg(dtype)
    kind = _device_kind(device, held["model"])

    def run() -> Estimate:
        mode = new_mode()
        fakes, real_of = {}, {}
        for name, m in held.items():
            fakes[name], reals = fake_copy(m, mode, dtype)
            real_of.update(reals)
        fake_in = fake_inputs(inputs, mode, real_integers=True)
        policy = fakes["model"]
        _checkpointing_as_in_train(trainer, policy)
        others = tuple(m for name, m in fakes.items() if name != "model")
        with _swapped(trainer, fakes), _as_in_training(trainer):
            est = _run(policy, fake_in, None, kind, dtype or _dtype_of(policy), real_of, mode, optimizer, _returned,
                       None, False, None, True, forward=_compute_loss(trainer), externals=others, around=_around(kind))
        est.notes.append(_NOTE)
        if kind == "cuda":
            est.notes.append(_TRL_CUDA_NOTE)
        return est

    try:
        return run()
    except DATA_DEPENDENT as e:
        raise ValueError("estimate_trainer: the step reads the values of a floating-point or integer result it "
                         f"computes ({e}), which a fake trace does not have; measure a real step instead "
                         "(leanact.estimate.measure_trainer)") from e


def measure_trainer(trainer, inputs: Any = None, *, optimizer: Any = "trainer") -> Estimate:
    """The measured counterpart of :func:`estimate_trainer`: one real step (CPU) with the same
    protocol, on deep copies of the trainer's models (the trainer's own are not updated)."""
    from .step import run_step

    held = _held_models(trainer)
    optimizer = _optimizer_arg(trainer, optimizer)
    if inputs is None:
        inputs = first_batch(trainer)
    copies = copy.deepcopy(held)
    policy = copies["model"]
    _checkpointing_as_in_train(trainer, policy)
    policy.train()
    with _swapped(trainer, copies), _as_in_training(trainer):
        mem = run_step(policy, inputs, optimizer=optimizer, loss_fn=_returned, forward=_compute_loss(trainer),
                       externals=tuple(m for name, m in copies.items() if name != "model"))
    return _result(mem, policy, "cpu", _dtype_of(policy), ["measured (real tensors)", _NOTE])
