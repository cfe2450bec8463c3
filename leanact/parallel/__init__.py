"""Tensor + sequence parallelism for (leanact-patched) Hugging Face models, on torch's DTensor styles;
context parallelism (the sequence over ranks, DeepSpeed-Ulysses): :mod:`leanact.parallel.context`.

Families: BERT/RoBERTa, LLaMA/Mistral/Qwen2, GPT-2 (fused ``Conv1D`` q|k|v split per block).

>>> mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world_size,))
>>> model = leanact.parallel.parallelize(leanact.patch(model), mesh, sequence_parallel=True)

Every Transformer layer is split with ``torch.distributed.tensor.parallel.parallelize_module``
(plans in :mod:`leanact.parallel.plans`): attention heads and the MLP's hidden units are split
t ways (Colwise/RowwiseParallel); with ``sequence_parallel`` the norms, the residual adds and the
hidden dropout run on s/t rows of each rank (Megatron's sequence parallelism), leanact's lean
norm ops on the local shards (:mod:`leanact.parallel.norm`), dropout masks as documented in
:mod:`leanact.parallel.dropout`; the column-parallel linears keep the s/t-row shard of their
input and all-gather it again in backward (:mod:`leanact.parallel.regather`), so each rank keeps
1/t of the single-process layer's activations. Embeddings and heads stay replicated. All communication is
DTensor's (all-gather / reduce-scatter / all-reduce through the process group of ``mesh``):
gloo on the CPU, NCCL on GPUs, the same code path.

Requirements: call it on every rank, with the same weights and the same ``torch.manual_seed``
on every rank (replicated regions must stay identical); the mesh is 1-D (the tensor-parallel
group); the head counts and the sequence length divide by its size. Feed every rank the same
full batch.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from .context import SUPPORTED_CONTEXT, SequenceExchange, SimulatedGroup, average_gradients, context_parallel
from .dropout import SequenceShardedDropout, ShardedDropoutStyle, fork_rng_per_rank
from .norm import LocalSequenceParallel
from .plans import SUPPORTED, GatherSequence, PrepareFirstInput, detect, layer_plan, stack_entry_exit
from .regather import RegatherTransform

__all__ = ["parallelize", "context_parallel", "average_gradients", "SequenceExchange", "SimulatedGroup",
           "SUPPORTED_CONTEXT", "SUPPORTED", "LocalSequenceParallel", "SequenceShardedDropout",
           "ShardedDropoutStyle", "PrepareFirstInput", "GatherSequence", "RegatherTransform", "fork_rng_per_rank"]


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = True, regather: bool = True) -> nn.Module:
    """Split ``model``'s Transformer layers over the 1-D ``mesh`` in place; returns ``model``.

    ``regather`` (with ``sequence_parallel``): the column-parallel linears keep the s/t-row shard of
    their input and all-gather it again in backward, as Megatron does
    (:mod:`leanact.parallel.regather`); False keeps the gathered full-sequence input instead.

    Raises ValueError for an unsupported model (the message says which are supported and why
    not), a mesh that is not 1-D, or head counts that do not divide by the mesh size.
    """
    if getattr(model, "_leanact_parallel", None) is not None:
        raise ValueError("leanact.parallel.parallelize: the model is already parallelized")
    if mesh.ndim != 1:
        raise ValueError(f"leanact.parallel.parallelize needs a 1-D tensor-parallel mesh, got {mesh.ndim}-D "
                         "(for TP + FSDP pass mesh['tp'] of a 2-D mesh)")
    family, config, layers = detect(model)
    t = mesh.size()
    heads, kv_heads = family.heads(config)
    if heads % t or kv_heads % t:
        raise ValueError(f"leanact.parallel: {heads} attention heads / {kv_heads} key-value heads do not divide "
                         f"by the tensor-parallel size {t}; use a mesh size dividing both")
    if any(d.type != mesh.device_type for d in {p.device for p in model.parameters()}):
        raise ValueError(f"leanact.parallel: move the model to {mesh.device_type!r} (the mesh's device type) first")
    transform = RegatherTransform() if sequence_parallel and regather else None
    plan = layer_plan(family, sequence_parallel, transform)
    rank = mesh.get_local_rank()
    for layer in layers:
        parallelize_module(layer, mesh, plan)
        attention = layer.get_submodule(family.attention)
        fork_rng_per_rank(attention, rank, lambda m, f=family: m.training and f.attention_dropout(m) > 0)
    entry, exit_ = stack_entry_exit(sequence_parallel)
    if entry is not None:
        parallelize_module(layers[0], mesh, entry)
        parallelize_module(layers[-1], mesh, exit_)
    if transform is not None:
        model.register_forward_pre_hook(lambda *_: transform.start())
        model.register_forward_hook(lambda *_: transform.stop(), always_call=True)
    object.__setattr__(model, "_leanact_parallel", (family.name, t, sequence_parallel))
    return model
