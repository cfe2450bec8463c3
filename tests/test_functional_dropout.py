"""``nn.functional.dropout`` calls in patched modeling code (BART) keep a seed, not a mask."""
import copy
import math
import pickle

import pytest
import torch

import leanact
from leanact.memory import SavedTensorMeter
from leanact.patching import functional_dropout as FD

transformers = pytest.importorskip("transformers")

P = 0.25


def _bart(p=P):
    cfg = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, dropout=p,
                                  activation_dropout=p, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(cfg).train()


def _kept(layer, x):
    with SavedTensorMeter(layer) as meter:
        layer(x, attention_mask=None)
    return meter.total_bytes


def _torch_mask_bytes(shapes):
    """What torch keeps for dropout calls on inputs of these shapes (its mask, measured)."""
    total = 0
    for shape in shapes:
        x = torch.randn(shape, requires_grad=True)
        with SavedTensorMeter() as meter:
            torch.nn.functional.dropout(x, P, True)
        total += meter.total_bytes
    return total


def test_bart_layer_keeps_seeds_not_masks():
    """The patched BART encoder layer keeps, to the byte, what it keeps with torch's functional dropout
    minus the three masks (attention output, activation, MLP output) plus three 8-byte seeds."""
    model = leanact.patch(_bart())
    layer = model.model.encoder.layers[0]
    assert "forward" in layer.__dict__
    x = torch.randn(2, 10, 32, requires_grad=True)
    calls = leanact.summary(model).functional_dropout.lean_calls
    lean = _kept(layer, x)
    assert leanact.summary(model).functional_dropout.lean_calls == calls + 3
    FD.uninstall(model)  # the same patched layer with torch's dropout calls
    assert "forward" not in layer.__dict__
    with_masks = _kept(layer, x)
    masks = _torch_mask_bytes([(2, 10, 32), (2, 10, 64), (2, 10, 32)])
    assert masks >= 2 * 10 * 128  # at least one byte per element
    assert lean == with_masks - masks + 3 * 8


def _single_call_layer():
    """A BART encoder layer whose only functional dropout with p > 0 is the last one (MLP output)."""
    model = leanact.patch(_bart())
    layer = model.model.encoder.layers[0]
    layer.activation_dropout = 0.0
    layer.self_attn_layer_norm = torch.nn.Identity()
    layer.final_layer_norm = torch.nn.Identity()
    layer.self_attn.forward = lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None)
    return model, layer


def test_statistics_and_gradient_given_the_mask():
    """Redirected call: ~(1-p) of the elements kept, scaled by 1/(1-p); the gradient is dy * mask / (1-p)
    with the mask read off the output (fc2's output bounded away from 0)."""
    _, layer = _single_call_layer()
    fc2 = layer.fc2
    x = torch.randn(4, 512, 32, dtype=torch.float64, requires_grad=True)
    layer.double()
    h = fc2(layer.activation_fn(layer.fc1(x))).detach()  # fc2's output: what the dropout sees
    y = layer(x, attention_mask=None)
    y = y[0] if isinstance(y, tuple) else y
    d = (y - x).detach()  # residual: y = x + dropout(h)
    mask = d != 0
    n = mask.numel()
    assert abs(mask.double().mean().item() - (1 - P)) < 5 * math.sqrt(P * (1 - P) / n)
    torch.testing.assert_close(d[mask], h[mask] / (1 - P), rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    (g_h,) = torch.autograd.grad(y, [layer.fc2.bias], dy)  # d/d(bias) = sum of dy * mask / (1-p)
    torch.testing.assert_close(g_h, (dy * mask / (1 - P)).sum((0, 1)), rtol=1e-12, atol=1e-12)


def test_eval_and_no_grad_are_untouched():
    ref, lean = _bart(), leanact.patch(_bart())
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    calls = leanact.summary(lean).functional_dropout.lean_calls
    with torch.no_grad():  # training mode without grad: torch's dropout, the same random stream
        torch.manual_seed(5)
        a = ref(input_ids=ids).logits
        torch.manual_seed(5)
        b = lean(input_ids=ids).logits
    assert torch.equal(a, b)
    ref.eval(), lean.eval()  # with grad: no dropout at all (lean norms differ by rounding only)
    torch.testing.assert_close(ref(input_ids=ids).logits, lean(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    assert leanact.summary(lean).functional_dropout.lean_calls == calls


class _Stop(BaseException):
    pass


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_mode_is_left_after_an_exception(error):
    model = leanact.patch(_bart())
    layer = model.model.encoder.layers[0]

    def boom(*args):
        assert FD.active()
        raise error("stop")

    layer.fc1.register_forward_pre_hook(boom)
    with pytest.raises(error):
        layer(torch.randn(2, 10, 32, requires_grad=True), attention_mask=None)
    assert not FD.active()
    assert torch._C._len_torch_function_stack() == 0


def test_checkpointed_layers_run_torch_dropout_and_match():
    """Under Hugging Face's gradient checkpointing the calls keep torch's dropout (its recompute runs
    outside the forward); gradients equal the unpatched model's with the same seed."""
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    grads = []
    for patched in (False, True):
        model = _bart()
        if patched:
            leanact.patch(model, fused_loss=False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.model.encoder.dropout = model.model.decoder.dropout = 0.0  # outside the checkpointed layers
        torch.manual_seed(7)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(model.model.encoder.layers[0].fc1.weight.grad)
        if patched:
            st = leanact.summary(model).functional_dropout
            assert st.lean_calls == 0 and st.torch_calls > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_unpatch(how):
    model = leanact.patch(_bart())
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    ids = torch.randint(3, 96, (2, 10))
    copied(input_ids=ids, labels=ids).loss.backward()
    assert leanact.summary(copied).functional_dropout.lean_calls > 0
    leanact.unpatch(copied)
    assert not any("forward" in m.__dict__ for m in copied.modules())
    row = leanact.summary(model).functional_dropout_row()
    assert row[0].startswith("functional dropout in BartEncoder")


def test_models_without_functional_dropout_report_none():
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=50)
    model = leanact.patch(transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(3, 50, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert leanact.summary(model).functional_dropout_row() is None
    assert not FD.active()
