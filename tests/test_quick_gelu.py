"""QuickGELU (x * sigmoid(1.702 x), Hugging Face's QuickGELUActivation, CLIP): the producer
``leanact.recompute.quick_gelu`` and its patch (``PatchedQuickGELU``).

The producer runs HF's very ops in forward and autograd's steps of that expression in backward, so
outputs and gradients are compared bitwise. Kept bytes are counted to the byte."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from leanact.memory import saved_bytes
from leanact.recompute import RecipeTransform, producers as P

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.patching import patch, summary, unpatch  # noqa: E402
from leanact.patching.modules import PatchedQuickGELU  # noqa: E402

QuickGELU = transformers.activations.QuickGELUActivation
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _hf_grads(x, dy):
    x = x.detach().requires_grad_()
    y = QuickGELU()(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


@pytest.mark.parametrize("dtype", DTYPES)
def test_producer_bitwise_hf(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 97, generator=g) * 4).to(dtype)  # both sides of the minimum, tails
    dy = torch.randn(64, 97, generator=g).to(dtype)
    ref_y, ref_dx = _hf_grads(x, dy)
    xl = x.clone().requires_grad_()
    y = P.quick_gelu(xl)
    (dx,) = torch.autograd.grad(y, xl, dy)
    assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx)
    with torch.no_grad():  # the plain expression, no graph
        y0 = P.quick_gelu(xl)
    assert y0.grad_fn is None and torch.equal(y0, ref_y)


def test_gradcheck_and_double_backward():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(P.quick_gelu, (x,))
    assert torch.autograd.gradgradcheck(P.quick_gelu, (x,))

    def consumed(x, w):  # the Linear's copy of the output is the recipe
        with RecipeTransform():
            return F.linear(P.quick_gelu(x), w)

    assert torch.autograd.gradcheck(consumed, (x, w))
    assert torch.autograd.gradgradcheck(consumed, (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes(dtype):
    x = torch.randn(4, 8, 16, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 16, dtype=dtype))
    n = x.numel() * x.element_size()
    assert saved_bytes(lambda: QuickGELU()(x).sum() * 1) == 2 * n  # autograd: x and sigmoid(1.702x)
    assert saved_bytes(lambda: P.quick_gelu(x)) == n  # x only
    assert saved_bytes(lambda: F.linear(QuickGELU()(x), w)) == 3 * n  # + the Linear's copy of y
    assert saved_bytes(lambda: F.linear(P.quick_gelu(x), w)) == 2 * n

    def in_transform():
        with RecipeTransform():
            return F.linear(P.quick_gelu(x), w)

    assert saved_bytes(in_transform) == n  # the Linear's copy rebuilt from x


def _clip_mlp(dtype=torch.float32, wrap=True):
    """CLIP's MLP; wrapped in a Sequential, patch replaces the MLP (LeanCLIPMLP), else (the root,
    which patch does not replace) only its activation (PatchedQuickGELU)."""
    cfg = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=16, patch_size=8)
    torch.manual_seed(0)
    m = transformers.models.clip.modeling_clip.CLIPMLP(cfg).to(dtype)
    return torch.nn.Sequential(m) if wrap else m


def _run(m, x, dy):
    xi = x.clone().requires_grad_()
    y = m(xi)
    y.backward(dy)
    return [y, xi.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrap", [True, False], ids=["mlp", "activation"])
def test_patched_bitwise_and_bytes(dtype, wrap):
    ref = _clip_mlp(dtype, wrap)
    lean = patch(copy.deepcopy(ref))
    if wrap:
        assert type(lean[0]).__name__ == "LeanCLIPMLP" and type(lean[0].activation_fn) is QuickGELU
        assert summary(lean).replaced == [("0", "CLIPMLP", "leanact.patching.LeanCLIPMLP")]
    else:
        assert type(lean.activation_fn) is PatchedQuickGELU
        assert summary(lean).replaced == [("activation_fn", "QuickGELUActivation", "leanact.patching.PatchedQuickGELU")]
    x = torch.randn(3, 5, 16, dtype=dtype)
    dy = torch.randn(3, 5, 16, dtype=dtype)
    for a, b in zip(_run(ref, x, dy), _run(lean, x, dy)):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(lean(x), ref(x))
    xg = x.clone().requires_grad_()
    i = 3 * 5 * 64 * x.element_size()  # one tensor of the intermediate size
    plain, kept = saved_bytes(lambda: ref(xg), ref), saved_bytes(lambda: lean(xg), lean)
    assert plain == xg.numel() * x.element_size() + 3 * i  # x; fc1 output, sigmoid, fc2's input
    assert kept == plain - (2 * i if wrap else i)  # not the sigmoid; with the MLP replaced, nor fc2's input
    # under autocast the patched model's forward runs in a recipe transform: fc2's copy is rebuilt either way
    xf = torch.randn(3, 5, 16, requires_grad=True)
    ref32, lean32 = _clip_mlp(wrap=wrap), patch(_clip_mlp(wrap=wrap))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, kept = saved_bytes(lambda: ref32(xf), ref32), saved_bytes(lambda: lean32(xf), lean32)
    i16, w16 = 3 * 5 * 64 * 2, 2 * 16 * 64 * 2
    assert kept == 3 * 5 * 16 * 2 + i16  # the bf16 casts of x (fc1) and fc1's output only
    assert plain == kept + 2 * i16 + w16  # + the sigmoid, fc2's copy, the bf16 weights (recast by the patch)
    unpatch(lean)
    assert type(lean[0] if wrap else lean.activation_fn) is (transformers.models.clip.modeling_clip.CLIPMLP
                                                            if wrap else QuickGELU)


def test_mlp_falls_back_when_activation_changed():
    """Hooks added to the activation after patching fire (HF's forward runs), with HF's numbers."""
    ref, lean = _clip_mlp(), patch(_clip_mlp())
    calls = []
    lean[0].activation_fn.register_forward_hook(lambda *a: calls.append(1))
    x, dy = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    for a, b in zip(_run(ref, x, dy), _run(lean, x, dy)):
        assert torch.equal(a, b)
    assert calls == [1]


def test_foreign_hooks_not_shadowed():
    """Under save_on_cpu (someone else's hooks) no recipe transform is entered: every tensor the
    MLP keeps goes through those hooks (fc1's output and fc2's input; not the sigmoid)."""
    ref, lean = _clip_mlp(), patch(_clip_mlp())
    x, dy = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    seen, got = [], []
    for m in (ref, lean):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t.numel()), t)[1], lambda t: t):
            got.append(_run(m, x, dy))
        seen.append(None)
    for a, b in zip(*got):
        assert torch.equal(a, b)
    n = 2 * 3 * 64
    hf, ours = seen[:seen.index(None)], seen[seen.index(None) + 1:-1]
    assert sorted(hf) == sorted(ours + [n, n])  # the same tensors minus the sigmoid (saved by sigmoid and by mul)


def test_checkpointed_mlp_bitwise():
    ref, lean = _clip_mlp(), patch(_clip_mlp())
    x, dy = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    ck = [torch.nn.Sequential(m) for m in (ref, lean)]
    for m in ck:
        m.forward = lambda t, m=m: torch.utils.checkpoint.checkpoint(m[0], t, use_reentrant=False)
    for a, b in zip(_run(*ck[:1], x, dy), _run(ck[1], x, dy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wrap", [True, False], ids=["mlp", "activation"])
def test_autocast_bitwise(wrap):
    ref = _clip_mlp(wrap=wrap)
    lean = patch(copy.deepcopy(ref))
    x = torch.randn(3, 5, 16)
    outs = []
    for m in (ref, lean):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        y.float().sum().backward()
        outs.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wrap", [True, False], ids=["mlp", "activation"])
def test_torch_func_runs_hf(wrap):
    ref = _clip_mlp(wrap=wrap)
    lean = patch(copy.deepcopy(ref))
    x = torch.randn(2, 3, 16)
    params = {k: v.detach() for k, v in ref.named_parameters()}

    def loss(m):
        return lambda p, x: torch.func.functional_call(m, p, (x,)).square().sum()

    a = torch.func.grad(loss(ref))(params, x)
    b = torch.func.grad(loss(lean))(params, x)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_left_with_reason():
    m = _clip_mlp()
    m[0].activation_fn.forward = lambda input: input * torch.sigmoid(1.702 * input)  # e.g. a hub kernel
    s = summary(patch(m))
    assert s.replaced == [] and [r for _, _, r in s.left] == ["QuickGELUActivation whose forward was replaced on "
                                                             "the instance (e.g. a hub kernel)"] * 2  # MLP, activation

    class Other(QuickGELU):
        def forward(self, input):
            return input * torch.sigmoid(1.7 * input)

    Other.__module__ = QuickGELU.__module__
    Other.__name__ = "QuickGELUActivation"
    m = _clip_mlp()
    m[0].activation_fn = Other()
    s = summary(patch(m))
    assert s.replaced == [] and len(s.left) == 2
    assert all("is not input * torch.sigmoid(1.702 * input)" in r for _, _, r in s.left)

    class OtherMLP(transformers.models.clip.modeling_clip.CLIPMLP):  # a forward that is not fc2(act(fc1(x)))
        def forward(self, hidden_states):
            return self.fc2(self.activation_fn(self.fc1(hidden_states))) * 2

    OtherMLP.__module__ = "transformers.models.clip.modeling_clip"
    m = _clip_mlp()
    m[0].__class__ = OtherMLP
    ref = copy.deepcopy(m)
    s = summary(patch(m))
    assert s.left == [("0", "OtherMLP", "forward is not fc2(activation_fn(fc1(x)))")]
    assert s.replaced == [("0.activation_fn", "QuickGELUActivation", "leanact.patching.PatchedQuickGELU")]
    x, dy = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    for a, b in zip(_run(ref, x, dy), _run(m, x, dy)):
        assert torch.equal(a, b)


def test_clip_model_patched_matches():
    cfg = transformers.CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=50, max_position_embeddings=12, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8), projection_dim=16)
    torch.manual_seed(0)
    ref = transformers.CLIPModel(cfg).train()
    lean = leanact.patch(copy.deepcopy(ref))
    mlps = [m for m in lean.modules() if type(m).__name__ == "LeanCLIPMLP"]
    assert len(mlps) == 4 and not any(type(m).__name__ == "CLIPMLP" for m in lean.modules())
    assert summary(lean).left == []
    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(3, 50, (4, 12), generator=g),
                 pixel_values=torch.randn(4, 3, 16, 16, generator=g), return_loss=True)
    l_ref, l_lean = ref(**batch).loss, lean(**batch).loss
    torch.testing.assert_close(l_lean, l_ref, rtol=1e-6, atol=0)  # leanact's LayerNorm: within rounding
    l_ref.backward()
    l_lean.backward()
    # norm-wise within 1e-5 (leanact's LayerNorm rounds differently); gradients that are 0 in exact
    # arithmetic (text q/k: softmax is shift-invariant) are rounding noise, bounded by 1e-6 of the median
    lp = dict(lean.named_parameters())
    grads = [(name, p.grad, lp[name].grad) for name, p in ref.named_parameters()]
    scale = torch.stack([g.norm() for _, g, _ in grads]).median()
    for name, g_ref, g_lean in grads:
        diff = (g_lean - g_ref).norm()
        bound = 1e-6 * scale if g_ref.norm() < 1e-6 * scale else 1e-5 * g_ref.norm()
        assert diff <= bound, (name, diff.item(), bound.item())
    with torch.no_grad():
        ref.eval(), lean.eval()
        assert torch.equal(ref(**batch).logits_per_image, lean(**batch).logits_per_image)
