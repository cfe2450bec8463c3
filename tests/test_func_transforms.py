"""leanact's ops and patched models under torch.func transforms (grad, vmap, jvp, jacrev).

Inside a transform, tensors are functorch wrappers without storage: the from-output decision of the
norms used to call ``data_ptr`` on them and crash (``torch.func.grad(functional_call(patched_model,
...))``), and the lean ops' custom autograd Functions cannot run there. The lean ops now run torch's
own ops under a transform (leanact.ops.transforms), so results equal the unpatched model's.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, vmap

import leanact
import leanact.functional as LF
from leanact.ops.norms.verdict import from_output_ok
from leanact.recompute import producers as P

from _tiny import tiny_batch, tiny_hf

pytestmark = pytest.mark.timeout(300)

H = 16


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, H, dtype=torch.float64, generator=g)
    w = 1 + 0.1 * torch.randn(H, dtype=torch.float64, generator=g)
    b = 0.1 * torch.randn(H, dtype=torch.float64, generator=g)
    return x, w, b


_B = _tensors()[2]
OPS = {  # name: (leanact, torch reference), both f(x, w) -> scalar
    "layer_norm": (lambda x, w: LF.layer_norm(x, (H,), w, _B).sin().sum(),
                   lambda x, w: F.layer_norm(x, (H,), w, _B).sin().sum()),
    "rms_norm": (lambda x, w: LF.rms_norm(x, (H,), w).sin().sum(), lambda x, w: F.rms_norm(x, (H,), w).sin().sum()),
    "gelu": (lambda x, w: (LF.gelu(x) * w).sin().sum(), lambda x, w: (F.gelu(x) * w).sin().sum()),
    "gelu_tanh": (lambda x, w: (LF.gelu(x, "tanh") * w).sin().sum(),
                  lambda x, w: (F.gelu(x, approximate="tanh") * w).sin().sum()),
    "nn.LayerNorm": (lambda x, w: functional_call(leanact.nn.LayerNorm(H, dtype=torch.float64),
                                                  {"weight": w, "bias": _B}, (x,)).sin().sum(),
                     lambda x, w: F.layer_norm(x, (H,), w, _B).sin().sum()),
    "recipe swiglu": (lambda x, w: P.swiglu(x, x * w).sin().sum(), lambda x, w: (F.silu(x) * x * w).sin().sum()),
    "recipe layer_norm": (lambda x, w: P.layer_norm(x, (H,), w, _B).sin().sum(),
                          lambda x, w: F.layer_norm(x, (H,), w, _B).sin().sum()),
    "recipe rms_norm": (lambda x, w: P.rms_norm(x, (H,), w).sin().sum(),
                        lambda x, w: F.rms_norm(x, (H,), w).sin().sum()),
    "recipe gelu": (lambda x, w: (P.gelu(x) * w).sin().sum(), lambda x, w: (F.gelu(x) * w).sin().sum()),
}
TRANSFORMS = {
    "grad": lambda f, x, w: grad(f, argnums=(0, 1))(x, w),
    "vmap(grad)": lambda f, x, w: vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(x, w),
    "jvp": lambda f, x, w: jvp(f, (x, w), (torch.ones_like(x), torch.ones_like(w))),
    "jacrev": lambda f, x, w: jacrev(f, argnums=1)(x, w),
}


@pytest.mark.slow
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("op", list(OPS))
def test_op_under_transform_matches_torch(op, transform):
    x, w, _ = _tensors()
    ours, ref = (TRANSFORMS[transform](f, x, w) for f in OPS[op])
    for a, r in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_dropout_under_grad_and_vmap_uses_the_seeded_mask():
    x = torch.randn(3, 5000)
    seed = torch.tensor(7)
    y = LF.dropout_seeded(x, seed, 0.3)
    g = grad(lambda x: LF.dropout_seeded(x, seed, 0.3).sum())(x)
    assert torch.equal(g, (y != 0).to(x.dtype) * (1 / 0.7))
    assert torch.equal(vmap(lambda r: LF.dropout_seeded(r, seed, 0.3))(x)[1], LF.dropout_seeded(x[1], seed, 0.3))


def test_from_output_ok_on_wrapped_weights():
    """The decision reads the wrapped weights' values (no data_ptr): True for sane γ, β; False when
    |β/γ| is too large, also when only one vmapped entry is bad."""
    w, b = torch.ones(H), torch.zeros(H)
    seen = []
    grad(lambda w: seen.append(from_output_ok(w, b, H, torch.float32)) or (w * w).sum())(w)
    grad(lambda b: seen.append(from_output_ok(w, b + 100, H, torch.float32)) or (b * b).sum())(b)
    bs = torch.zeros(3, H)
    bs[2, 0] = 100
    vmap(lambda b: seen.append(from_output_ok(w, b, H, torch.float32)) or b)(bs)
    assert seen == [True, False, False]


def _func_grads(model):
    batch = tiny_batch()
    params = {k: v.detach() for k, v in model.named_parameters()}
    return grad(lambda p: functional_call(model, p, (), batch).loss)(params)


def _assert_close(ours, ref, tol=1e-5):
    """Every gradient within ``tol`` relative to the model's largest gradient norm (a parameter whose
    true gradient is ~0 does not dominate)."""
    scale = max(g.norm().item() for g in ref.values())
    assert ours.keys() == ref.keys()
    for k in ref:
        assert (ours[k] - ref[k]).norm().item() <= tol * max(ref[k].norm().item(), 1e-3 * scale), k


@pytest.mark.parametrize("attention", ["recompute", False])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_func_grad_of_patched_model_matches_unpatched(family, attention):
    pytest.importorskip("transformers")
    ref = _func_grads(tiny_hf(family))
    model = leanact.patch(tiny_hf(family), attention=attention)
    replaced = {old for _, old, _ in leanact.summary(model).replaced}
    assert replaced >= ({"LayerNorm", "GELUActivation"} if family == "bert" else {"LlamaRMSNorm", "LlamaMLP"}), replaced
    ours = _func_grads(model)
    _assert_close(ours, ref)
    # and the same gradients as ordinary autograd on the patched model (lean ops active there)
    model.zero_grad()
    model(**tiny_batch()).loss.backward()
    _assert_close(ours, {k: p.grad for k, p in model.named_parameters()})


def _modules():
    from leanact.nn import fused

    return {"LeanMLP": lambda: fused.LeanMLP(H, 2 * H, "gelu"),
            "LeanMLP swiglu": lambda: fused.LeanMLP(H, 2 * H, "swiglu"),
            "LayerNormLinears": lambda: fused.LayerNormLinears(H, [H, H // 2]),
            "TransformerEncoderLayer": lambda: leanact.nn.TransformerEncoderLayer(H, 2, 2 * H, dropout=0.0,
                                                                                 batch_first=True)}


@pytest.mark.parametrize("name", ["LeanMLP", "LeanMLP swiglu", "LayerNormLinears", "TransformerEncoderLayer"])
def test_lean_module_under_grad_matches_autograd(name):
    torch.manual_seed(0)
    m = _modules()[name]()
    x = torch.randn(2, 5, H)

    def loss(params):
        out = functional_call(m, params, (x,))
        return sum(o.sin().sum() for o in (out if isinstance(out, (list, tuple)) else [out]))

    ours = grad(loss)({k: v.detach() for k, v in m.named_parameters()})
    loss(dict(m.named_parameters())).backward()  # ordinary autograd: the lean path
    _assert_close(ours, {k: p.grad for k, p in m.named_parameters()})
