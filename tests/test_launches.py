"""How many kernels each lean op starts on CUDA, counted on the CPU: the Triton launches (the
kernel path run with a recording stand-in for the kernels module, so nothing is computed) and the
aten operations dispatched around them that start a kernel of their own (allocations, views and
detaches start none). These are the "launches per op" of docs/triton.md; each one costs a launch
on the GPU and host time per call, which decides the step time of small batches.

RMSNorm's forward is torch's ``_fused_rms_norm``: one kernel on CUDA, a composite on the CPU, so
its forward's aten count is not the GPU's and is not asserted.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import leanact.nn as lnn
from leanact.ops.gated_mlp import gated_down
from leanact.ops.triton import dispatch

#: aten operations that start no kernel (allocation, metadata)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "select", "slice", "detach", "alias",
              "as_strided", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "_reshape_alias",
              "reshape", "lift_fresh", "promote_types", "result_type"}  # (the last two: dtype arithmetic)


class _Aten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _Kernels:
    """Stands for a kernels module: every launcher records its name and computes nothing."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append(name)


def _count(run, params):
    """(aten ops, Triton launches) of ``run()``'s forward, then of its backward (grads reset first,
    so that no accumulation into an existing .grad is counted), after one uncounted call: what is
    done once (GELU's tables per device, a norm's from-output decision per optimizer step) is not
    counted."""
    kernels = _Kernels()
    with dispatch.use_kernels(kernels, strict=True, fake=False):
        run().sum().backward()
        out = []
        y = None
        for direction in ("forward", "backward"):
            for p in params:
                p.grad = None
            kernels.calls.clear()
            if y is not None:
                dy = torch.ones_like(y)
            with _Aten() as aten:
                if direction == "forward":
                    y = run()
                else:
                    y.backward(dy)
            out.append((aten.ops, list(kernels.calls)))
    return out


def _x(dtype, n=64):
    return torch.randn(8, n, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_one_kernel_forward_two_backward(dtype):
    x, m = _x(dtype), lnn.LayerNorm(64).to(dtype)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: m(x), [x, *m.parameters()])
    assert (f_aten, f_k) == (["native_layer_norm"], [])  # torch's own kernel: it returns y and rstd
    assert (b_aten, b_k) == ([], ["norm_backward", "norm_partials_sum"])  # dx and partials; dγ, dβ


@pytest.mark.parametrize("needs", ["x", "w", "b", "xw"])
def test_layer_norm_backward_launches_only_what_is_needed(needs):
    x, m = _x(torch.bfloat16), lnn.LayerNorm(64).to(torch.bfloat16)
    x.requires_grad_("x" in needs)
    m.weight.requires_grad_("w" in needs)
    m.bias.requires_grad_("b" in needs)
    (_, _), (b_aten, b_k) = _count(lambda: m(x), [x, *m.parameters()])
    assert b_aten == []
    assert b_k == ["norm_backward"] + (["norm_partials_sum"] if needs != "x" else [])


@pytest.mark.parametrize("from_output", [True, False])
def test_rms_norm_two_kernels_backward(from_output):
    x, m = _x(torch.bfloat16), lnn.RMSNorm(64, from_output=from_output).to(torch.bfloat16)
    (_, f_k), (b_aten, b_k) = _count(lambda: m(x), [x, *m.parameters()])
    assert f_k == []  # torch's _fused_rms_norm (see the module doc)
    assert (b_aten, b_k) == ([], ["norm_backward", "norm_partials_sum"])  # ÷ γ inside the second one


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gelu_one_kernel_each_way(approximate, dtype):
    x, m = _x(dtype), lnn.GELU(approximate)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: m(x), [x])
    assert f_aten == b_aten == []
    assert len(f_k) == len(b_k) == 1 and "forward" in f_k[0] and "backward" in b_k[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dropout_one_kernel_each_way_and_a_seed(dtype):
    x, m = _x(dtype), lnn.Dropout(0.1)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: m(x), [x])
    assert (f_aten, f_k) == (["randint"], ["dropout_apply"])  # the 8-byte seed, drawn on the device
    assert (b_aten, b_k) == ([], ["dropout_apply"])  # the mask regenerated from the seed in the kernel


@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float32])
def test_dropout_add_layer_norm_one_kernel_forward_two_backward(h_dtype):
    """The sub-layer end LayerNorm(dropout(h) + residual): the seed and one kernel forward (HF's three
    ops: dropout, add, norm), the norm's two backward kernels write both gradients (HF: the norm's,
    the add's cast, the dropout's)."""
    from leanact.ops.norms.dropout_add_norm import dropout_add_layer_norm

    h, r, m = _x(h_dtype), _x(torch.float32), lnn.LayerNorm(64)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: dropout_add_layer_norm(h, r, 64, m.weight, m.bias, 1e-5, 0.1),
                                          [h, r, *m.parameters()])
    assert (f_aten, f_k) == (["randint"], ["norm_forward"])
    assert (b_aten, b_k) == ([], ["norm_backward", "norm_partials_sum"])


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_one_kernel_each_way_beside_its_matmuls(kind):
    g, u = _x(torch.bfloat16, 96), _x(torch.bfloat16, 96)
    w = torch.randn(64, 96, dtype=torch.bfloat16, requires_grad=True)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: gated_down(g, u, w, kind=kind), [g, u, w])
    assert (f_aten, f_k) == (["mm"], ["glu_forward"])  # act(g)·u, then the down projection
    assert (b_aten, b_k) == (["mm", "mm"], ["glu_backward"])  # dh = dy·W; dg, du and h; dW = dyᵀ·h


def test_rotary_one_kernel_for_q_and_k_each_way():
    """RoPE of q and k (leanact.ops.rotary): one kernel for both forward, one for their gradients
    backward (both, or the one there is), no aten kernel around them; Hugging Face's
    apply_rotary_pos_emb starts 5 per tensor forward (a negation, a concatenation, two products, a
    sum) and 9 per gradient backward (two products and their casts to q's dtype, the negation, two
    zero-padded slices, two sums): docs/triton.md."""
    from leanact.ops.rotary import rotary, rotary_reference

    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 8, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: rotary(q, k, cos, sin)[0], [q])
    assert (f_aten, f_k) == ([], ["rotary"]) and (b_aten, b_k) == ([], ["rotary"])
    k.requires_grad_()  # both gradients: still one kernel
    kernels = _Kernels()
    with dispatch.use_kernels(kernels, strict=True, fake=False), _Aten() as aten:
        outs = rotary(q, k, cos, sin)
        torch.autograd.backward(outs, [torch.ones(t.shape, dtype=t.dtype) for t in outs])
    assert kernels.calls == ["rotary", "rotary"] and "mul" not in aten.ops, (kernels.calls, aten.ops)
    cos, sin = cos.float(), sin.float()  # (fp32 tables, as under autocast: the products promote, then cast back)
    (f_aten, f_k), (b_aten, b_k) = _count(lambda: rotary_reference(q, cos, sin), [q])  # HF's arithmetic
    assert f_k == [] and sorted(f_aten) == ["add", "cat", "mul", "mul", "neg"]
    assert sorted(b_aten) == ["_to_copy", "_to_copy", "add", "add", "mul", "mul", "neg", "slice_backward",
                              "slice_backward"], b_aten
