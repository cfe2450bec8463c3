"""torch.compile on leanact-patched HF layers.

* A patched BertLayer compiles with fullgraph=True and gives eager's output and gradients, dropout
  included, with the LayerNorms' from-output decision fixed (``m.from_output = True``) or automatic:
  then taken when the graph is traced and asserted on the device at every run
  (:mod:`leanact.ops.norms.verdict`); a γ that stops passing after compiling raises leanact's error.
* A patched LlamaDecoderLayer likewise (the lean HF RMSNorms), and matches eager.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact.nn as lnn  # noqa: E402
from test_parallel_tp import build  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _layer(family, dropout=0.0):
    model = build(family, dropout=dropout, attn_dropout=dropout, layers=1)
    if family == "bert":
        layer = model.bert.encoder.layer[0]
        kwargs = {}
    else:
        layer = model.model.layers[0]
        pos = torch.arange(16)[None].expand(2, 16)
        kwargs = dict(position_embeddings=model.model.rotary_emb(torch.randn(2, 16, 64), pos))
    return layer, kwargs


def _run(fn, layer, kwargs, seed=5):
    torch.manual_seed(seed)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    layer.zero_grad()
    y = fn(x, **kwargs)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _assert_same(a, b, tol):
    (ya, xa, ga), (yb, xb, gb) = a, b
    assert torch.allclose(ya, yb, rtol=tol, atol=tol)
    assert torch.allclose(xa, xb, rtol=tol, atol=tol)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=tol, atol=tol), n


def _fix_layer_norm_decision(layer):
    """The automatic from-output check of leanact.nn.LayerNorm reads γ, β on the host (a graph
    break); fixing the decision (here True: γ, β are sane) makes the layer one graph."""
    norms = [m for m in layer.modules() if isinstance(m, lnn.LayerNorm)]
    assert norms
    for m in norms:
        m.from_output = True


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_bert_layer_fullgraph_aot_eager(dropout):
    torch._dynamo.reset()
    layer, kwargs = _layer("bert", dropout)
    _fix_layer_norm_decision(layer)
    eager = _run(layer, layer, kwargs)
    compiled = _run(torch.compile(layer, backend="aot_eager", fullgraph=True), layer, kwargs)
    _assert_same(eager, compiled, 1e-5)  # dropout: the same seeds, so the same masks


@pytest.mark.parametrize("family, backend", [("bert", "aot_eager"), ("llama", "aot_eager"),
                                             pytest.param("bert", "inductor", marks=pytest.mark.slow)])
def test_automatic_decision_traces_and_is_asserted_at_every_run(family, backend):
    """The automatic from-output decision is taken when the graph is traced (no graph break:
    fullgraph=True) and every run checks γ on the device: a zero entry written into γ after compiling
    stops the compiled step with leanact's error; a graph traced on that γ keeps the norm's input and
    runs, exact."""
    torch._dynamo.reset()
    layer, kwargs = _layer(family)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    _assert_same(_run(layer, layer, kwargs), _run(compiled, layer, kwargs), 1e-4 if backend == "inductor" else 1e-5)
    norm = next(m for n, m in layer.named_modules() if n.endswith(("output.LayerNorm", "post_attention_layernorm")))
    with torch.no_grad():
        norm.weight[3] = 0.0
    with pytest.raises(RuntimeError, match="leanact: a compiled norm recovers its input from its output"):
        _run(compiled, layer, kwargs)
    torch._dynamo.reset()
    recompiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    _assert_same(_run(layer, layer, kwargs), _run(recompiled, layer, kwargs), 1e-5)


@pytest.mark.slow
def test_llama_layer_fullgraph_aot_eager():
    from leanact.patching.hf_rms_norm import _LeanHFRMSNorm

    torch._dynamo.reset()
    layer, kwargs = _layer("llama")
    for m in layer.modules():
        if isinstance(m, _LeanHFRMSNorm):
            m.from_output = True
    eager = _run(layer, layer, kwargs)
    compiled = _run(torch.compile(layer, backend="aot_eager", fullgraph=True), layer, kwargs)
    _assert_same(eager, compiled, 1e-5)


@pytest.mark.slow
def test_bert_layer_fullgraph_inductor():
    torch._dynamo.reset()
    layer, kwargs = _layer("bert", 0.1)
    _fix_layer_norm_decision(layer)
    eager = _run(layer, layer, kwargs)
    compiled = _run(torch.compile(layer, fullgraph=True), layer, kwargs)
    _assert_same(eager, compiled, 1e-4)  # inductor reorders fp32 reductions
