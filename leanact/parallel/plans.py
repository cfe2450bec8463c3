"""Per-family tensor/sequence-parallel plans, keyed on Hugging Face module names.

A plan maps module names, relative to one Transformer layer, to torch's DTensor parallel styles.
With ``sequence_parallel=True`` (Megatron's layout) the residual stream between layers is
``Shard(1)`` (sequence dim) in each rank's local tensors:

    norm / dropout / residual add   : on s/t rows           (LocalSequenceParallel, ShardedDropoutStyle)
    attention / MLP input           : all-gather to s rows  (GatherSequence: PrepareModuleInput Shard(1) -> Replicate;
                                      the linears keep the shard and re-gather it in backward,
                                      leanact.parallel.regather)
    q, k, v / fc1 (gate, up)        : column-parallel, heads / h_ff split t ways (ColwiseParallel)
    attention out / fc2 (down)      : row-parallel, reduce-scatter to s/t rows (RowwiseParallel)

The attention module receives the gathered full sequence, so HF's ``view(*input_shape, -1,
head_dim)`` gives the local head count (the -1), and the attention mask and rotary tables built
by the model for the full sequence match. Embeddings and heads stay replicated (every rank
computes them on the full sequence); the first layer splits the sequence, the last gathers it.
Without sequence parallelism the residual stream is replicated and row-parallel outputs are
all-reduced (Megatron's plain tensor parallelism). GPT-2's transformers ``Conv1D`` projections and
its fused q|k|v (c_attn) use the styles of :mod:`leanact.parallel.gpt2`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
)

from .dropout import ShardedDropoutStyle
from .gpt2 import Conv1DColwise, Conv1DRowwise, GPT2AttentionStyle
from .norm import LocalSequenceParallel

__all__ = ["Family", "GatherSequence", "PrepareFirstInput", "detect", "layer_plan", "SUPPORTED"]


class PrepareFirstInput(PrepareModuleInput):
    """``PrepareModuleInput`` for the first positional argument only (the others pass through),
    for modules called with a varying number of positional arguments (HF layers)."""

    def __init__(self, input_layout, desired_layout, use_local_output: bool = True):
        super().__init__(input_layouts=(input_layout,), desired_input_layouts=(desired_layout,),
                         use_local_output=use_local_output)

    def _prepare_input_fn(self, inputs, device_mesh):
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        want = self.desired_input_layouts[0]
        if isinstance(want, Shard) and not isinstance(self.input_layouts[0], Shard):
            n, t = inputs[0].shape[want.dim], device_mesh.size()
            if n % t:
                raise ValueError(f"leanact.parallel: sequence length {n} does not divide by the tensor-parallel "
                                 f"size {t}; pad the batch to a multiple of {t}")
        first = self._prepare_input_arg(inputs[0], device_mesh, self.input_layouts[0], self.desired_input_layouts[0])
        return (first, *inputs[1:])


class GatherSequence(PrepareModuleInput):
    """All-gather the sequence-sharded input (first positional argument, or ``kwarg``) of a module
    that needs the full sequence (attention, MLP); registers the gathered tensor with ``regather``
    (a :class:`~leanact.parallel.regather.RegatherTransform`) so that the linears keep the shard."""

    def __init__(self, kwarg: str | None = None, regather=None):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        self.kwarg, self.regather = kwarg, regather

    def _gather(self, x, mesh):
        full = self._prepare_input_arg(x, mesh, Shard(1), Replicate())
        if self.regather is not None:
            self.regather.register(full, x.to_local() if isinstance(x, DTensor) else x, mesh, 1)
        return full

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def pre(_module, args, kwargs):
            if self.kwarg is None:
                args = (self._gather(args[0], device_mesh), *args[1:])
            else:
                kwargs = {**kwargs, self.kwarg: self._gather(kwargs[self.kwarg], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


@dataclass(frozen=True)
class Family:
    """How to find and split one model family's layers."""

    name: str
    layer_class_suffix: str  # e.g. "BertLayer", "DecoderLayer"
    attention: str  # attention module (relative to the layer): gets the full sequence, heads split
    heads: Callable[[object], tuple[int, int]]  # config -> (query heads, key/value heads)
    attention_dropout: Callable[[nn.Module], float]  # attention module -> its dropout probability
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    norms: tuple[str, ...]
    dropouts: tuple[str, ...]  # dropout modules on the residual stream (sequence-parallel region)
    gathered: tuple[tuple[str, str | None], ...]  # (module, kwarg name or None = first positional)
    # module name -> column-parallel style; (module name, output placement) -> row-parallel style
    colwise_style: Callable[[str], object] = lambda name: ColwiseParallel()
    rowwise_style: Callable[[str, object], object] = lambda name, out: RowwiseParallel(output_layouts=out)
    # the attention module's style (the sequence gather or None) -> the style to apply to it
    attention_style: Callable[[object], object] = lambda inner: inner


BERT = Family(
    name="bert",
    layer_class_suffix="Layer",
    attention="attention.self",
    heads=lambda c: (c.num_attention_heads, c.num_attention_heads),
    attention_dropout=lambda m: float(getattr(m.dropout, "p", 0.0)),
    colwise=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
    rowwise=("attention.output.dense", "output.dense"),
    norms=("attention.output.LayerNorm", "output.LayerNorm"),
    dropouts=("attention.output.dropout", "output.dropout"),
    gathered=(("attention.self", None), ("intermediate", None)),
)

LLAMA = Family(
    name="llama",
    layer_class_suffix="DecoderLayer",
    attention="self_attn",
    heads=lambda c: (c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
    attention_dropout=lambda m: float(getattr(m, "attention_dropout", 0.0) or 0.0),
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    norms=("input_layernorm", "post_attention_layernorm"),
    dropouts=(),
    gathered=(("self_attn", "hidden_states"), ("mlp", None)),
)

GPT2 = Family(
    name="gpt2",
    layer_class_suffix="GPT2Block",
    attention="attn",
    heads=lambda c: (c.n_head, c.n_head),
    attention_dropout=lambda m: float(getattr(m.attn_dropout, "p", 0.0)),
    colwise=("attn.c_attn", "mlp.c_fc"),
    rowwise=("attn.c_proj", "mlp.c_proj"),
    norms=("ln_1", "ln_2"),
    dropouts=("attn.resid_dropout", "mlp.dropout"),
    gathered=(("attn", None), ("mlp", None)),
    # transformers' Conv1D projections; c_attn's output is q | k | v: each block split across ranks
    colwise_style=lambda name: Conv1DColwise(fused=3 if name == "attn.c_attn" else 1),
    rowwise_style=lambda name, out: Conv1DRowwise(output_layouts=out),
    attention_style=GPT2AttentionStyle,  # local split_size / num_heads for the split of q | k | v
)

# model_type -> family. BERT-style encoders share BertLayer's module names; LLaMA-style decoders
# (pre-norm, separate q/k/v and gate/up/down projections, standard RMSNorm) share LlamaDecoderLayer's.
SUPPORTED: dict[str, Family] = {
    "bert": BERT, "roberta": BERT,
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA,
    "gpt2": GPT2,
}
_UNSUPPORTED_WHY: dict[str, str] = {}


def detect(model: nn.Module):
    """(family, config, layers ModuleList) for a supported HF model, else ValueError saying why."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(f"leanact.parallel needs a Hugging Face model (with .config.model_type); got "
                         f"{type(model).__name__}. Supported model types: {sorted(SUPPORTED)}.")
    if model_type not in SUPPORTED:
        why = _UNSUPPORTED_WHY.get(model_type, "no tensor-parallel plan for it yet")
        raise ValueError(f"leanact.parallel: model type {model_type!r} is not supported ({why}). "
                         f"Supported: {sorted(SUPPORTED)}.")
    family = SUPPORTED[model_type]
    stacks = [m for _, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
              and all(type(x).__name__.endswith(family.layer_class_suffix) for x in m)]
    if len(stacks) != 1:
        raise ValueError(f"leanact.parallel: expected one stack of *{family.layer_class_suffix} modules in "
                         f"{type(model).__name__}, found {len(stacks)}")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("leanact.parallel: cross-attention layers are not supported (add_cross_attention=True)")
    return family, config, stacks[0]


def layer_plan(family: Family, sequence_parallel: bool, regather=None) -> dict:
    """Module name (relative to a layer) -> ParallelStyle (``regather``: see GatherSequence)."""
    plan: dict = {}
    for name in family.colwise:
        plan[name] = family.colwise_style(name)
    out = Shard(1) if sequence_parallel else Replicate()
    for name in family.rowwise:
        plan[name] = family.rowwise_style(name, out)
    if sequence_parallel:
        for name in family.norms:
            plan[name] = LocalSequenceParallel(use_local_output=True)
        for name in family.dropouts:
            plan[name] = ShardedDropoutStyle(use_local_output=True)
        for name, kwarg in family.gathered:
            plan[name] = GatherSequence(kwarg, regather)
    attention = family.attention_style(plan.get(family.attention))
    if attention is not None:
        plan[family.attention] = attention
    return plan


def stack_entry_exit(sequence_parallel: bool):
    """Styles for the first layer (split the replicated sequence) and the last (gather it)."""
    if not sequence_parallel:
        return None, None
    return (PrepareFirstInput(Replicate(), Shard(1)),
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
