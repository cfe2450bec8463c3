"""The fused RoPE rotation (leanact.ops.rotary) and its routing from Hugging Face models
(leanact.patching.hf_rotary), on the PyTorch path (the kernels: tests/test_triton_rotary.py).

* the PyTorch path is bitwise Hugging Face's ``apply_rotary_pos_emb`` forward and autograd's
  backward through it, for every pair of tensor / table dtypes (the kernel's self-check compares
  with these);
* the op's float64 gradcheck;
* the routing: Llama-form functions recognised by bytecode in transformers' modeling modules (and
  another form not), marked tables only, unpatch, copies, ``attention=False``; on a CPU the
  original function runs (the kernels need CUDA or the interpreter).
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from leanact.ops.rotary import function as R

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as ML  # noqa: E402

import leanact  # noqa: E402
from leanact.patching import hf_rotary as H  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(x_dtype, t_dtype, batch_tables=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, 9, 3, 6, generator=g) * 3).to(x_dtype).transpose(1, 2)  # HF's (B, H, S, D) view
    k = (torch.randn(2, 1, 9, 6, generator=g) * 3).to(x_dtype)
    cos = torch.randn(batch_tables, 9, 6, generator=g).to(t_dtype)
    sin = torch.randn(batch_tables, 9, 6, generator=g).to(t_dtype)
    return q, k, cos, sin


def _bitwise(a, b):
    return a.dtype == b.dtype and torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.parametrize("x_dtype,t_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_pytorch_path_is_hf_bitwise(x_dtype, t_dtype):
    q, k, cos, sin = _inputs(x_dtype, t_dtype)
    q.requires_grad_()
    k.requires_grad_()
    qe, ke = ML.apply_rotary_pos_emb(q, k, cos, sin)
    assert _bitwise(R.rotary_reference(q, cos, sin), qe) and _bitwise(R.rotary_reference(k, cos, sin), ke)
    g = torch.Generator().manual_seed(1)
    gq, gk = (torch.randn(t.shape, generator=g).to(t.dtype) for t in (qe, ke))
    dq, dk = torch.autograd.grad((qe, ke), (q, k), (gq, gk))
    assert _bitwise(R.rotary_backward_reference(gq, cos, sin, x_dtype), dq)
    assert _bitwise(R.rotary_backward_reference(gk, cos, sin, x_dtype), dk)
    # the Function (its PyTorch path on a CPU) is the same
    fq, fk = R.RotaryFunction.apply(q, k, cos, sin)
    assert _bitwise(fq, qe) and _bitwise(fk, ke)
    assert all(_bitwise(a, b) for a, b in zip(torch.autograd.grad((fq, fk), (q, k), (gq, gk)), (dq, dk)))


def test_gradcheck_float64():
    q, k, cos, sin = _inputs(torch.float64, torch.float64, batch_tables=1)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: R.RotaryFunction.apply(a, b, cos, sin), (q, k))


def test_rotary_declines_what_the_kernels_do_not_take():
    """None (the caller runs HF's function) on a CPU; with launches stubbed (what a CUDA call would
    do), None for tables needing a gradient, mismatched or odd shapes, other dtypes or ranks."""
    from leanact.ops.triton import dispatch

    q, k, cos, sin = _inputs(torch.float32, torch.float32)
    assert R.rotary(q, k, cos, sin) is None  # a CPU
    with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=False):
        out = R.rotary(q, k, cos, sin)
        assert out is not None and out[0].shape == q.shape and out[0].stride() == q.stride()
        assert R.rotary(q, k, cos.requires_grad_(), sin) is None
        cos.requires_grad_(False)
        assert R.rotary(q, k.double(), cos, sin) is None
        assert R.rotary(q[..., :5], k[..., :5], cos[..., :5], sin[..., :5]) is None  # odd D
        assert R.rotary(q, k, cos[:, :4], sin[:, :4]) is None  # tables for other positions
        assert R.rotary(q, k, cos.unsqueeze(1), sin.unsqueeze(1)) is None  # tables already unsqueezed
        assert R.rotary(q.double(), k.double(), cos.double(), sin.double()) is None  # float64: not a kernel dtype
        assert R.rotary(q[0], k[0], cos, sin) is None


# ---- routing from Hugging Face models -------------------------------------------------------------

def _llama(layers=2):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite"])
def test_llama_form_recognised(family):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert H._llama_form(module)


def test_other_forms_not_recognised():
    """Cohere rotates interleaved pairs and GPT-NeoX a part of the head: their functions differ."""
    import importlib

    for family in ("cohere", "gpt_neox"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert not H._llama_form(module), family

    def changed(q, k, cos, sin, unsqueeze_dim=1):
        """a docstring"""
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) - (rotate_half(q) * sin)  # noqa: F821 - a sign flipped
        k_embed = (k * cos) + (rotate_half(k) * sin)  # noqa: F821
        return q_embed, k_embed

    hf = getattr(ML.apply_rotary_pos_emb, H._WRAPPED, ML.apply_rotary_pos_emb)  # (routed by an earlier patch)
    assert not H._same_code(changed, H._apply_form) and H._same_code(hf, H._apply_form)


def test_patch_routes_marked_tables_only(monkeypatch):
    """The patched model's tables are marked and reach the op; an unpatched model's do not; on a
    CPU the op declines and HF's function runs: the same loss and gradients as unpatched."""
    ref = _llama()
    model = leanact.patch(copy.deepcopy(ref))
    assert any("rotary: q and k rotated" in n for n in leanact.summary(model).notes)
    assert H.installed(model) == 1 and getattr(ML.apply_rotary_pos_emb, H._WRAPPED) is not None
    seen = []
    real = H.rotary
    monkeypatch.setattr(H, "rotary", lambda q, k, cos, sin: seen.append(q.shape) or real(q, k, cos, sin))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    ref(input_ids=ids, labels=ids).loss.backward()
    assert seen == []  # unpatched: not marked
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(seen) == 2  # one call per layer
    cos, sin = model.model.rotary_emb(model.model.embed_tokens(ids), torch.arange(12)[None])
    assert getattr(cos, H.MARK) and getattr(sin, H.MARK)
    copied = copy.deepcopy(model)
    assert H.installed(copied) == 1 and copied.model.rotary_emb.forward.module is copied.model.rotary_emb
    leanact.unpatch(model)
    assert H.installed(model) == 0 and "forward" not in model.model.rotary_emb.__dict__
    cos, _ = model.model.rotary_emb(model.model.embed_tokens(ids), torch.arange(12)[None])
    assert not hasattr(cos, H.MARK)


def test_attention_false_leaves_the_rotation():
    model = leanact.patch(_llama(), attention=False)
    assert H.installed(model) == 0 and not any("rotary" in n for n in leanact.summary(model).notes)


def test_replacement_routes_marked_tables_with_unsqueeze_dim_1_only():
    """With launches stubbed (what a CUDA call would run: outputs allocated, nothing computed), a
    call the kernels must not take -- unmarked tables, or unsqueeze_dim=2 -- returns HF's values;
    marked tables with unsqueeze_dim=1 go to the op (the stub's unwritten outputs)."""
    from leanact.ops.triton import dispatch

    q, k, cos, sin = _inputs(torch.float32, torch.float32)
    H._route(ML)
    original = getattr(ML.apply_rotary_pos_emb, H._WRAPPED)
    routed = []
    real = H.rotary
    H_rotary = lambda *a: routed.append(1) or real(*a)  # noqa: E731
    qb, kb = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D): unsqueeze_dim=2
    with dispatch.use_kernels(dispatch.SHAPES_ONLY, strict=True, fake=False):
        H.rotary = H_rotary
        try:
            unmarked = ML.apply_rotary_pos_emb(q, k, cos, sin)
            for t in (cos, sin):
                setattr(t, H.MARK, True)
            dim2 = ML.apply_rotary_pos_emb(qb, kb, cos, sin, unsqueeze_dim=2)
            assert routed == []
            ML.apply_rotary_pos_emb(q, k, cos, sin)
            assert routed == [1]
        finally:
            H.rotary = real
    assert all(_bitwise(a, b) for a, b in zip(unmarked, original(q, k, cos, sin)))
    assert all(_bitwise(a, b) for a, b in zip(dim2, original(qb, kb, cos, sin, unsqueeze_dim=2)))


@pytest.mark.slow
def test_estimate_models_the_kernel(monkeypatch):
    """leanact.estimate(device="cuda") runs the rotation as the kernels would (the op on fake tensors,
    its launches stubbed), and what it keeps is what HF's function keeps (the tables): the same kept
    bytes as with the kernels off."""
    model = leanact.patch(_llama())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, labels=ids)
    calls = []
    real = R.RotaryFunction.apply
    monkeypatch.setattr(R.RotaryFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("LEANACT_TRITON", raising=False)
    kernels = leanact.estimate(model, inputs, device="cuda")
    assert len(calls) == 2  # one per layer
    monkeypatch.setenv("LEANACT_TRITON", "0")
    torch_path = leanact.estimate(model, inputs, device="cuda")
    assert len(calls) == 2 and kernels.per_layer == torch_path.per_layer and kernels.peak <= torch_path.peak
