"""The lossy ``compress`` option cannot leave compression on for the thread.

It used to be entered by a forward pre-hook on the model and left by an always-called forward hook;
torch runs always-called hooks after an ``Exception`` only, so a KeyboardInterrupt (any
BaseException) raised inside the forward left the transform and torch's saved-tensor hooks active:
a later plain bf16 Linear got an fp8-compressed weight gradient, and every forward without backward
(plain models too) went through Python saved-tensor hooks, whose reference cycles keep
self-saving outputs alive. The transform is now entered with ``with`` around the model's forward.
"""
import copy
import gc
import inspect
import pickle
import weakref

import pytest
import torch
from torch import nn

import leanact
from leanact import lossy
from leanact.nn.fused import RecipeGELU
from leanact.recompute import scope
from leanact.saved import active_transforms

pytestmark = pytest.mark.timeout(300)

COMPRESS = {"compress": {"format": "fp8", "min_numel": 1}}  # tiny tensors compressed too
H = 64


def _stack(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Sequential(nn.Linear(H, H), nn.LayerNorm(H)),
                         nn.Linear(H, H)).to(dtype)


def _plain_linear_grad():
    torch.manual_seed(1)
    lin = nn.Linear(H, H).to(torch.bfloat16)
    x = torch.randn(32, H, dtype=torch.bfloat16)
    lin(x).float().pow(2).sum().backward()
    return lin.weight.grad


def _grads(model, x):
    model.zero_grad()
    model(x).float().pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _no_hooks_left():
    return active_transforms() == [] and torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_exception_inside_forward_leaves_no_compression_behind(exc):
    exact = _plain_linear_grad()
    model = leanact.patch(_stack(), lossy=COMPRESS)
    x = torch.randn(32, H, dtype=torch.bfloat16)
    before = _grads(model, x)

    def interrupt(*_):
        raise exc("stop")

    handle = model[2].register_forward_hook(interrupt)  # a middle layer: compression is on there
    with pytest.raises(exc):
        model(x)
    handle.remove()
    assert _no_hooks_left()
    assert torch.equal(_plain_linear_grad(), exact)  # not an fp8-compressed weight gradient
    # a forward without backward frees a self-saving output (exp keeps its result) by refcount
    t = torch.randn(H, H, requires_grad=True)
    y = t.exp()
    ref = weakref.ref(y)
    gc.disable()
    try:
        del y
        assert ref() is None
    finally:
        gc.enable()
    # and the lossy model still compresses, as before the interrupt
    after = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert not all(torch.equal(a, b) for a, b in zip(after, _grads(_stack(), x)))  # (it is lossy)


def test_compressed_forward_keeps_signature_copies_and_removes():
    transformers = pytest.importorskip("transformers")
    from _tiny import tiny_hf

    model = leanact.patch(tiny_hf("llama"), attention=False, lossy="fp8")
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.forward.module is twin and lossy.state(twin).forward is twin.forward
        lossy.remove(twin)
        # what is left is the patch's own wrapper (a recipe transform under autocast), not compression
        assert twin.__dict__["forward"] is twin._leanact_patch.state["cast_recipes"]
    assert isinstance(model, transformers.LlamaForCausalLM)
    leanact.unpatch(model)
    assert "forward" not in model.__dict__ and lossy.state(model) is None


def test_tensors_kept_as_recipes_are_not_compressed():
    """A recipe scope on the model itself is entered before the model's forward (so outside the
    compression): the output of a recipe producer is still kept as an exact recipe."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), RecipeGELU(), nn.Linear(H, H)).to(torch.bfloat16)
    x = torch.randn(32, H, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with scope(model):
        lossy.apply(model, COMPRESS)
        model(x).float().sum().backward()
    # fc2's weight gradient (ones^T · GELU output) reads only the kept GELU output: a recipe, exact
    assert torch.equal(model[2].weight.grad, exact[2])
    assert not torch.equal(model[0].weight.grad, exact[0])  # fc1's input was compressed


def test_recipe_scope_survives_keyboard_interrupt():
    """recompute.scope enters its RecipeTransform (saved-tensor hooks) around the forward in one
    frame: an interrupt inside the forward leaves no hooks active."""
    import leanact

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))

    def boom(mod, args):
        raise KeyboardInterrupt

    handle = leanact.recompute.scope(model)
    h = model[1].register_forward_pre_hook(boom)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4, requires_grad=True))
    h.remove()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing left pushed
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()  # and the scope still works
    handle.remove()
    assert "forward" not in model.__dict__
