"""User hooks on modules that leanact.patch replaces keep firing.

A module with any hook registered on it before patching (forward, forward-pre, either with kwargs,
full backward, full backward-pre) is left, with the reason in the summary; hooks registered after
patching on a replacement fire as on any module; hooks registered after patching on the ``act_fn``
of a lean SwiGLU MLP (which the lean path does not call) send the call to HF's forward, so they
fire with autograd too. Before: an ``nn.RMSNorm`` with a forward hook was replaced (hook lost),
``register_full_backward_pre_hook`` hooks were lost on every replaced type, and a forward hook on
a Llama ``mlp.act_fn`` fired under no_grad only.
"""
import pytest
import torch
from torch import nn

import leanact

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

H = 8


def _llama_config():
    return transformers.LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=32)


def _module(kind):
    from transformers.activations import GELUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    return {"nn.GELU": lambda: nn.GELU(), "nn.LayerNorm": lambda: nn.LayerNorm(H), "nn.RMSNorm": lambda: nn.RMSNorm(H),
            "nn.Dropout": lambda: nn.Dropout(0.25), "GELUActivation": lambda: GELUActivation(),
            "LlamaRMSNorm": lambda: LlamaRMSNorm(H), "LlamaMLP": lambda: LlamaMLP(_llama_config())}[kind]()


KINDS = ["nn.GELU", "nn.LayerNorm", "nn.RMSNorm", "nn.Dropout", "GELUActivation", "LlamaRMSNorm", "LlamaMLP"]


def _register(m, hook, calls):
    """Register one hook of kind ``hook`` on ``m`` that counts its calls; returns the handle."""
    def note(*_args):
        calls.append(hook)

    if hook == "forward":
        return m.register_forward_hook(lambda mod, args, out: note())
    if hook == "forward-kwargs":
        return m.register_forward_hook(lambda mod, args, kwargs, out: note(), with_kwargs=True)
    if hook == "forward-pre":
        return m.register_forward_pre_hook(lambda mod, args: note())
    if hook == "forward-pre-kwargs":
        return m.register_forward_pre_hook(lambda mod, args, kwargs: note(), with_kwargs=True)
    if hook == "backward":
        return m.register_full_backward_hook(lambda mod, gin, gout: note())
    if hook == "backward-pre":
        return m.register_full_backward_pre_hook(lambda mod, gout: note())
    raise ValueError(hook)


HOOKS = ["forward", "forward-kwargs", "forward-pre", "forward-pre-kwargs", "backward", "backward-pre"]


def _step(model):
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("kind", KINDS)
def test_module_hooked_before_patching_is_left_and_its_hook_fires(kind, hook):
    model = nn.Sequential(nn.Linear(H, H), _module(kind)).train()
    calls = []
    _register(model[1], hook, calls)
    leanact.patch(model)
    assert type(model[1]).__name__ == kind.split(".")[-1]  # left as it was
    left = {name: why for name, _, why in leanact.summary(model).left}
    assert "hooks registered on it" in left.get("1", ""), leanact.summary(model).left
    _step(model)
    assert calls == [hook]


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("kind", KINDS)
def test_hook_registered_on_replacement_after_patching_fires(kind, hook):
    model = leanact.patch(nn.Sequential(nn.Linear(H, H), _module(kind)).train())
    assert ("1", kind.split(".")[-1]) in {(n, old) for n, old, _ in leanact.summary(model).replaced}
    calls = []
    _register(model[1], hook, calls)
    _step(model)
    assert calls == [hook]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_on_act_fn_of_lean_mlp_fires_with_autograd(hook):
    """HF's forward calls act_fn; the lean path does not: with a hook on act_fn (registered after
    patching) the lean MLP runs HF's forward, which fires it, with the same gradients."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(H, H), LlamaMLP(_llama_config()))
    model = leanact.patch(nn.Sequential(nn.Linear(H, H), LlamaMLP(_llama_config())))
    model.load_state_dict(ref.state_dict())
    assert type(model[1]).__name__ == "LeanLlamaMLP"
    calls = []
    handle = _register(model[1].act_fn, hook, calls)
    _step(model)
    assert calls == [hook]
    _step(ref)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    handle.remove()
    calls.clear()
    _step(model)  # hook removed: the lean path again, nothing fires
    assert calls == []


def test_act_fn_hooked_on_a_whole_llama_fires_in_training():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32, attn_implementation="sdpa")
    model = leanact.patch(transformers.LlamaForCausalLM(cfg).train())
    seen = []
    model.model.layers[0].mlp.act_fn.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    ids = torch.randint(0, 32, (2, 5))
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen == [torch.Size([2, 5, 32])]


def test_state_dict_hooks_leave_the_module():
    model = nn.Sequential(nn.Linear(H, H), nn.LayerNorm(H))
    loaded = []
    model[1].register_load_state_dict_post_hook(lambda mod, keys: loaded.append(mod))
    leanact.patch(model)
    assert type(model[1]) is nn.LayerNorm
    assert [why for n, _, why in leanact.summary(model).left if n == "1"] == [
        "has hooks registered on it (load_state_dict-post): left as is so that they keep firing"]
    model.load_state_dict(model.state_dict())
    assert loaded == [model[1]]
