"""TRL's fused LM head with leanact's backward (leanact.ops.cross_entropy.trl_logprobs, installed for a
patched model's ``fused_lm_head=True`` calls by leanact.patching.trl_head): TRL's gradients bit for
bit, the step's peak without the fp32 buffer of the weight's size, TRL's function back after every
call."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from trl.kernels import chunked_logprob as kernels  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

import leanact  # noqa: E402
from leanact.ops.cross_entropy.trl_logprobs import compatible, lean_class  # noqa: E402

N, V, H, CHUNK = 300, 1000, 64, 256  # 300 tokens in chunks of 128 (monkeypatched), 4 vocabulary tiles
OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")


def _inputs(dtype, bias, frozen_weight=False):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_(not frozen_weight)
    b = (0.1 * torch.randn(V, generator=g)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, b, t


def _grads(fn, h, w, b, t, softcap, entropy_grad=True):
    """Per-token outputs and the gradients of Σ g1·log p + Σ g2·entropy."""
    g = torch.Generator().manual_seed(1)
    g1, g2 = torch.randn(N, generator=g), torch.randn(N, generator=g)
    out = fn.apply(h, w, b, t, 0.7, CHUNK, softcap, 1.3, OUTPUTS)
    loss = (out[0] * g1).sum() + ((out[1] * g2).sum() if entropy_grad else 0)
    params = [p for p in (h, w, b) if p is not None and p.requires_grad]
    return [o for o in out if o is not None], torch.autograd.grad(loss, params)


@pytest.fixture
def small_token_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "TOKEN_CHUNK_SIZE", 128)


#: a TRL release whose head changed gets TRL's own head (the last test); the tests of leanact's backward skip
written_for = pytest.mark.skipif(compatible(kernels) is not None,
                                 reason=f"leanact's backward is not for this TRL: {compatible(kernels)}")


@written_for
def test_one_subclass_of_trls_function():
    lean = lean_class(kernels)
    assert issubclass(lean, kernels.ChunkedLogProbFunction) and lean is lean_class(kernels)


@written_for
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("frozen_weight", [False, True])
@pytest.mark.parametrize("sliced", [False, True])
def test_gradients_are_trls_bit_for_bit(dtype, bias, softcap, frozen_weight, sliced, small_token_chunks, monkeypatch):
    """Token chunks × vocabulary tiles summed in the same order as TRL's backward: equal bits, with and
    without bias, softcap, entropy's gradient, a frozen weight (LoRA), in fp32 and bf16; with TRL's torch
    fold run on slices of 5 rows (what bounds its temporaries on a CPU) too."""
    from leanact.ops.cross_entropy import trl_logprobs

    if sliced:
        monkeypatch.setattr(trl_logprobs, "_FOLD_ELEMENTS", 5 * CHUNK)
    for entropy_grad in (True, False):
        trl_out, trl_grads = _grads(kernels.ChunkedLogProbFunction, *_inputs(dtype, bias, frozen_weight), softcap,
                                    entropy_grad)
        out, grads = _grads(lean_class(kernels), *_inputs(dtype, bias, frozen_weight), softcap, entropy_grad)
        assert all(torch.equal(a, b) for a, b in zip(trl_out, out))
        assert len(grads) == len(trl_grads) == 2 + bias - frozen_weight
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(trl_grads, grads))


@written_for
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_late_weight_gradient_in_small_tiles(dtype, small_token_chunks, monkeypatch):
    """late_weight_grad with a tied embedding: the head's weight gradient computed in the embedding's
    backward, in vocabulary tiles of 96 rows (not TRL's 256): TRL's gradient to the dtype's rounding;
    the hidden states' gradient is TRL's bit for bit."""
    from leanact.ops.cross_entropy import trl_logprobs
    from leanact.ops.embedding import handed_off, tied_embedding

    monkeypatch.setattr(trl_logprobs, "_LATE_TILE", 96)
    h0, w0, _, t = _inputs(dtype, False)
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    g1 = torch.randn(N, generator=torch.Generator().manual_seed(4))
    grads = {}
    for name, fn, emb in (("trl", kernels.ChunkedLogProbFunction, torch.nn.functional.embedding),
                          ("late", lean_class(kernels, True), tied_embedding)):
        w = w0.detach().clone().requires_grad_()
        mix = h0.detach()[:H].clone()
        h = torch.tanh(emb(ids, w) @ mix)
        h.retain_grad()
        before = handed_off()
        out = fn.apply(h, w, None, t, 0.7, CHUNK, None, 1.3, ("log_probs", "entropy"))
        ((out[0] * g1).sum() + out[1].sum()).backward()
        assert handed_off() - before == (name == "late")
        grads[name] = (h.grad, w.grad)
    assert torch.equal(grads["late"][0], grads["trl"][0])
    want = grads["trl"][1]
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(grads["late"][1], want, rtol=tol, atol=tol * want.abs().max().item())


@written_for
def test_gradients_against_float64_truth(small_token_chunks):
    """Against autograd of the composite in float64 (log-softmax of the scaled, soft-capped logits over
    the temperature): TRL's forward folds every tile in fp32 whatever the inputs' dtype, so a float64
    gradcheck cannot resolve its finite differences; the bound is fp32's, relative to each gradient's
    norm."""
    h, w, b, t = _inputs(torch.float64, True)
    g = torch.Generator().manual_seed(1)
    g1 = torch.randn(N, generator=g, dtype=torch.float64)
    lp = lean_class(kernels).apply(h, w, b, t, 0.7, CHUNK, 30.0, 1.3, ("log_probs",))[0]
    got = torch.autograd.grad((lp * g1).sum(), (h, w, b))
    z = 30.0 * torch.tanh((h @ w.t() + b) * 1.3 / 30.0) / 0.7
    ref_lp = torch.log_softmax(z, -1).gather(-1, t[:, None])[:, 0]
    want = torch.autograd.grad((ref_lp * g1).sum(), (h, w, b))
    assert (lp - ref_lp).abs().max() <= 1e-5 * ref_lp.abs().max()
    for a, r in zip(got, want):
        assert (a - r).norm() <= 1e-5 * r.norm()


class _Head(torch.nn.Module):
    def __init__(self, fn, weight, targets):
        super().__init__()
        self.weight, self.t, self.fn = torch.nn.Parameter(weight), targets, fn

    def forward(self, h):
        return self.fn.apply(h, self.weight, None, self.t, 1.0, CHUNK, None, 1.0, ("log_probs",))[0].sum()


@written_for
def test_backward_peak_has_no_fp32_buffer_of_the_weights_size():
    """bf16 weight, a vocabulary of 32,768: TRL's backward holds an fp32 (V, H) accumulator and its bf16
    cast together (V·H·6 bytes); leanact's holds the bf16 gradient (V·H·2) and one tile's rows of fp32
    and the tile's temporaries (under 1 MiB here). What the forward keeps is TRL's, to the byte."""
    from leanact.estimate import measure

    v, n = 32768, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, H, generator=g).to(torch.bfloat16).requires_grad_()
    w = (0.1 * torch.randn(v, H, generator=g)).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    got = {name: measure(_Head(fn, w.clone(), t), (h,), optimizer=None, loss_fn=lambda out, _: out)
           for name, fn in (("trl", kernels.ChunkedLogProbFunction), ("lean", lean_class(kernels)))}
    assert got["trl"].saved == got["lean"].saved
    above = {k: e.peak - e.params for k, e in got.items()}
    assert above["trl"] >= v * H * 6 and above["lean"] <= v * H * 2 + 2**20


def _model(tied=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, attn_implementation="sdpa",
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()


@contextlib.contextmanager
def _functions_used():
    """The names of the head functions TRL's forward applies inside the block."""
    seen = []
    original = kernels.ChunkedLogProbFunction.apply.__func__

    def spy(cls, *args):
        seen.append(cls.__name__)
        return original(cls, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.ChunkedLogProbFunction, "apply", classmethod(spy))
        yield seen


def _step(model, lean_head: bool):
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with _functions_used() as seen:
        if not lean_head:
            leanact.patching.trl_head.remove(model)
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    assert trl_utils._ChunkedLogProbFunction is kernels.ChunkedLogProbFunction  # TRL's back after the call
    return seen, {n: p.grad for n, p in model.named_parameters()}


@written_for
def test_patched_model_runs_it_for_fused_lm_head_calls_only():
    """A patched causal LM under TRL's ``add_fused_lm_head``: calls with ``fused_lm_head=True`` run the lean
    backward (TRL's gradients bit for bit), TRL's function is back after each call; a plain call and
    an unpatched model run TRL's head; the summary says so."""
    from trl.trainer.utils import add_fused_lm_head

    model = leanact.patch(_model())
    twin = copy.deepcopy(model)
    for m in (model, twin):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    seen, grads = _step(model, True)
    seen_trl, want = _step(twin, False)
    assert seen == ["LeanChunkedLogProb"] and seen_trl == ["ChunkedLogProbFunction"]
    assert grads.keys() == want.keys() and all(torch.equal(grads[n], want[n]) for n in grads)
    assert any("TRL's fused LM head" in n for n in leanact.summary(model).notes)
    with pytest.raises(TypeError, match="late_head_grad"):
        leanact.patch(_model(), late_head_grad="yes")
    assert model(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, V)  # a plain call: HF's head
    assert trl_utils._ChunkedLogProbFunction is kernels.ChunkedLogProbFunction
    leanact.unpatch(model)
    assert not leanact.patching.trl_head.installed(model)


@written_for
@pytest.mark.filterwarnings("ignore::FutureWarning")  # (gradient_checkpointing_enable: renamed in transformers 5.24)
@pytest.mark.parametrize("checkpointing,late_head_grad", [(False, None), (True, None), (True, False), (False, True)])
def test_tied_weight_gradient_made_once(checkpointing, late_head_grad, monkeypatch):
    """Tied embeddings (Llama 3.2 1B's): the lean head hands its dW to the embedding's node
    (leanact.ops.embedding), which adds its token rows into it: W's gradient is made once and equals,
    bit for bit, what autograd makes from TRL's head and torch's embedding. Under gradient
    checkpointing (or with ``late_head_grad=True``) the head computes dW late, inside the embedding's
    backward, so that it is not held while the layers' backward runs."""
    from trl.trainer.utils import add_fused_lm_head

    from leanact.ops.cross_entropy import trl_logprobs
    from leanact.ops.embedding import TiedEmbeddingFunction, handed_off

    model = leanact.patch(_model(tied=True), late_head_grad=late_head_grad)
    late = checkpointing if late_head_grad is None else late_head_grad
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    twin = copy.deepcopy(model)
    for m in (model, twin):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    calls, inside = [], [False]
    tiles, backward = trl_logprobs._tiles, TiedEmbeddingFunction.backward

    def spy_tiles(*args):
        calls.append((args[-2], inside[0]))  # (need_w, in the embedding's backward)
        return tiles(*args)

    def spy_backward(ctx, grad):
        inside[0] = True
        try:
            return backward(ctx, grad)
        finally:
            inside[0] = False

    monkeypatch.setattr(trl_logprobs, "_tiles", spy_tiles)
    monkeypatch.setattr(TiedEmbeddingFunction, "backward", staticmethod(spy_backward))
    before = handed_off()
    seen, grads = _step(model, True)
    assert handed_off() - before == 1 and seen == ["LeanChunkedLogProb"]
    assert calls == ([(False, False), (True, True)] if late else [(True, False)])
    _, want = _step(twin, False)  # TRL's head: autograd adds its dW and the embedding's
    assert grads.keys() == want.keys()
    tied = "model.embed_tokens.weight"
    assert all(torch.equal(grads[n], want[n]) for n in grads if n != tied or not late)
    if late:  # (the late tiles' logits can round otherwise: bf16's rounding of W's gradient)
        torch.testing.assert_close(grads[tied], want[tied], rtol=2**-7, atol=2**-7 * want[tied].abs().max().item())


@written_for
def test_trls_function_is_back_when_the_call_raises():
    from trl.trainer.utils import add_fused_lm_head

    model = leanact.patch(_model())
    add_fused_lm_head(model)
    with pytest.raises(IndexError):
        model(input_ids=torch.tensor([[3, V + 5]]), labels=torch.tensor([[3, 4]]), fused_lm_head=True)
    assert trl_utils._ChunkedLogProbFunction is kernels.ChunkedLogProbFunction


@written_for
def test_under_torch_compile_trls_head_runs_as_it_is(monkeypatch):
    """While dynamo traces (is_compiling), the hooks neither swap TRL's function nor keep any state."""
    from trl.trainer.utils import add_fused_lm_head

    model = leanact.patch(_model())
    add_fused_lm_head(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with _functions_used() as seen:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert seen == ["ChunkedLogProbFunction"] and not leanact.patching.trl_head._SWAPPED.get(model)


@written_for
def test_a_forward_it_does_not_read_gets_trls_backward(monkeypatch):
    """A ctx without what TRL's forward keeps (another TRL's forward), or a gradient reaching an output
    other than the log-probabilities and the entropy: TRL's own backward answers."""
    import types

    from leanact.ops.cross_entropy.trl_logprobs import _backward

    calls = []
    monkeypatch.setattr(kernels.ChunkedLogProbFunction, "backward",
                        staticmethod(lambda ctx, *grads: calls.append(len(grads)) or "trl"))
    bare = types.SimpleNamespace(saved_tensors=(torch.zeros(1),) * 6)
    assert _backward(kernels, bare, torch.ones(2), None) == "trl"
    full = types.SimpleNamespace(saved_tensors=(torch.zeros(1),) * 6, compute_dtype=torch.float32, chunk_size=4,
                                 kernel_args={})
    assert _backward(kernels, full, torch.ones(2), None, torch.ones(2)) == "trl"
    assert _backward(kernels, types.SimpleNamespace(**{**vars(full), "saved_tensors": (torch.zeros(1),) * 7}),
                     torch.ones(2), None) == "trl"
    assert calls == [2, 3, 2]


def test_a_trl_it_was_not_written_for_runs_trls_head_and_says_why(monkeypatch):
    from trl.trainer.utils import add_fused_lm_head

    monkeypatch.setattr(kernels, "_backward_tile", lambda tile, targets: None)
    monkeypatch.setattr(leanact.patching.trl_head, "_WARNED", set())
    model = leanact.patch(_model())
    add_fused_lm_head(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.warns(UserWarning, match="TRL's fused LM head runs as it is .*tile fold takes"), \
            _functions_used() as seen:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert seen == ["ChunkedLogProbFunction"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        model(input_ids=ids, labels=ids, fused_lm_head=True)


@written_for
def test_triton_kernels_under_the_interpreter(monkeypatch):
    """The backward's launches of TRL's Triton tile kernel (what runs on a GPU), under Triton's
    interpreter on CPU tensors: TRL's gradients bit for bit."""
    if type(kernels._backward_kernel).__name__ != "InterpretedFunction":
        pytest.skip("TRL's kernels were not built under Triton's interpreter in this process")
    monkeypatch.setattr(kernels, "_use_triton", lambda device: True)
    monkeypatch.setattr(kernels, "TOKEN_CHUNK_SIZE", 16)
    g = torch.Generator().manual_seed(0)
    n, v, h = 40, 300, 16
    base = (torch.randn(n, h, generator=g), 0.1 * torch.randn(v, h, generator=g),
            torch.randint(0, v, (n,), generator=g))
    g1 = torch.randn(n, generator=g)
    got = []
    for fn in (kernels.ChunkedLogProbFunction, lean_class(kernels)):
        x, w = (t.clone().requires_grad_() for t in base[:2])
        lp, ent, *_ = fn.apply(x, w, None, base[2], 0.9, 128, None, 1.0, ("log_probs", "entropy"))
        got.append(torch.autograd.grad((lp * g1).sum() + ent.sum(), (x, w)))
    assert all(torch.equal(a, b) for a, b in zip(*got))

