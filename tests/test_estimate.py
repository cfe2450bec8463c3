"""leanact.estimate: predicted (fake tensors) vs measured (real tensors, MemTracker, one training
step on the CPU) on BERT, GPT-2 and LLaMA geometries (h=128, 4 layers, s=64, b=4, padded), fp32/bf16,
unpatched and leanact.patch'ed; a BERT-Large estimate without real memory; strategies; CUDA model.
(The measured step runs every op through MemTracker's Python dispatch: the geometry is small so
that the 12 combinations take about a minute; the prediction is exact at any size.)"""
import logging
import re
import resource
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.estimate import estimate, estimate_config, measure  # noqa: E402
from leanact.memory import measure_layer_cost  # noqa: E402

H, L, S, B, V = 128, 4, 64, 4, 1000


def _build(family, dtype=torch.float32, layers=L, h=H):
    torch.manual_seed(0)
    T = transformers
    ffn = 688 * h // 256
    if family == "bert":
        m = T.BertForMaskedLM(T.BertConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=4,
                                           intermediate_size=4 * h, vocab_size=V, attn_implementation="sdpa"))
    elif family == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(n_embd=h, n_layer=layers, n_head=4, vocab_size=V, n_positions=2 * S,
                                           attn_implementation="sdpa"))
    else:
        m = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=ffn, vocab_size=V,
                                             max_position_embeddings=2 * S, attn_implementation="sdpa"))
    return m.to(dtype)


def _inputs(b=B, s=S):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s // 2:] = 0  # padding: the attention mask is materialised in the real run too
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _check(family, dtype, patched, small=False):
    model = _build(family, dtype, layers=2, h=64) if small else _build(family, dtype)
    if patched:
        leanact.patch(model)
    before = [p.detach().clone() for p in model.parameters()]
    x = _inputs(2, 32) if small else _inputs()
    pred = estimate(model, x)
    real = measure(model, x)
    for field in ("peak", "activations"):
        p, m = getattr(pred, field), getattr(real, field)
        assert abs(p - m) / m <= 0.05, (field, p, m)
    assert pred.per_layer == real.per_layer  # the meter's count, byte for byte
    assert pred.saved == real.saved
    assert (pred.params, pred.grads, pred.optimizer_state) == (real.params, real.grads, real.optimizer_state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # model untouched
    return pred, real


@pytest.mark.parametrize("family,dtype,patched", [
    ("bert", torch.float32, False), ("llama", torch.bfloat16, True),
    pytest.param("gpt2", torch.bfloat16, True, marks=pytest.mark.slow)])
def test_predicted_vs_measured_small(family, dtype, patched):
    """h=64, 2 layers, s=32, b=2 (fast); the full geometry matrix is the slow test below."""
    _check(family, dtype, patched, small=True)


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_predicted_vs_measured_all(family, dtype, patched):
    _check(family, dtype, patched)


@pytest.mark.slow
def test_per_layer_equals_measure_layer_cost():
    """The estimate's middle layer = leanact.memory.measure_layer_cost (2 layers - 1 layer, real)."""
    def build(n):
        return leanact.patch(_build("llama", torch.bfloat16, layers=n, h=128))

    inputs = _inputs(2, 64)
    cost = measure_layer_cost(build, lambda: tuple(inputs.values()), 64, 2, 128)
    est = estimate(build(4), inputs)
    assert est.per_layer["model.layers.1"] == est.per_layer["model.layers.2"] == cost.bytes


def test_saved_by_module_as_measured():
    """Estimate.saved_by_module: the kept bytes of each module, as a measured step finds them; a part's
    bytes (saved_under) add up to the whole, and a layer's are its per_layer entry."""
    model = leanact.patch(_build("llama", layers=2, h=64))
    x = _inputs(2, 32)
    est, real = estimate(model, x), measure(model, x)
    assert est.saved_by_module == real.saved_by_module and len(est.saved_by_module) > 4
    assert est.saved_under("") == est.saved == sum(est.saved_by_module.values())
    parts = {name.split(".")[0].split("/")[0] for name in est.saved_by_module}
    assert sum(est.saved_under(p) for p in parts) == est.saved
    assert all(est.saved_under(name + ".") == n for name, n in est.per_layer.items())
    assert est.saved_under("model.layers.1") > 0 == est.saved_under("model.layers.9")


@pytest.mark.slow
def test_batch_seq_dtype_scaling():
    model = _build("llama", layers=2, h=64)
    small = estimate(model, _inputs(2, 32), dtype=torch.bfloat16)
    big = estimate(model, _inputs(2, 32), dtype=torch.bfloat16, batch=4, seq=64)
    assert small.params * 2 == estimate(model, _inputs(2, 32)).params  # bf16 weights: half
    assert big.per_layer["model.layers.1"] > 3.9 * small.per_layer["model.layers.1"]
    assert big.per_layer == estimate(model, _inputs(4, 64), dtype=torch.bfloat16).per_layer


@pytest.mark.slow
def test_big_geometry_without_real_memory():
    """BERT-Large, batch 32, seq 512, built from its config under FakeTensorMode: a few seconds,
    no real weights or activations (RSS grows far less than the ~20 GiB predicted peak)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                   intermediate_size=4096, attn_implementation="sdpa")  # BERT-Large
    ids = torch.zeros(32, 512, dtype=torch.long)
    est = estimate_config(cfg, dict(input_ids=ids, labels=ids), model_class=transformers.BertForMaskedLM)
    elapsed = time.perf_counter() - t0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    assert est.params > 1.3e9 and est.optimizer_state >= 2 * est.params - 1e6
    assert est.peak > 10 * 2**30 and len(est.per_layer) == 24
    assert grown < 0.02 * est.peak, grown
    assert elapsed < 60, elapsed  # typically a few seconds; generous for a loaded CI machine


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
def test_config_in_a_dtype_equals_the_real_model_in_that_dtype(patched):
    """estimate_config(dtype=bf16): the fake model is cast to bf16 (tied weights stay tied) and
    predicts what the real bf16 model does."""
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=V, attn_implementation="sdpa")
    x = _inputs(2, 32)
    fake = estimate_config(cfg, x, model_class=transformers.BertForMaskedLM, patch=patched, dtype=torch.bfloat16)
    torch.manual_seed(0)
    real = transformers.BertForMaskedLM(cfg).to(torch.bfloat16)
    if patched:
        leanact.patch(real)
    assert fake.to_dict() == estimate(real, x).to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("padded", [True, False])  # a 4-D mask; the causal triangle alone (blocks grow)
def test_fewer_slices_on_fake_tensors_give_the_same_estimate(padded, monkeypatch):
    """The estimate runs two of the GELU's eager slices and the last three attention blocks on fake
    tensors (leanact.ops.fake_rules.FakeRun.fewer_iterations): the same numbers as every slice and block
    (here 8 of each, the last block ragged), fp32 and float64 (whose slices allocate)."""
    import importlib

    api = importlib.import_module("leanact.estimate.api")
    torch.manual_seed(0)
    model = leanact.patch(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=V, n_positions=1024, attn_implementation="sdpa")))
    x = _inputs(2, 1000)
    if not padded:
        del x["attention_mask"]
    for dtype in (torch.float32, torch.float64):
        fast = estimate(model, x, dtype=dtype)
        monkeypatch.setattr(api, "_FEWER_ITERATIONS", False)
        full = estimate(model, x, dtype=dtype)
        monkeypatch.undo()
        assert fast.to_dict() == full.to_dict(), dtype


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_fewer_loss_tiles_on_fake_tensors_give_the_same_estimate(grad_in_forward, monkeypatch):
    """The fused linear + cross-entropy runs the first two and the last of its token and vocabulary
    tiles on fake tensors: the same numbers as all of them (here 7 x 5 tiles, the last ones ragged)."""
    import importlib

    from leanact.ops.cross_entropy.function import linear_cross_entropy

    api = importlib.import_module("leanact.estimate.api")

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(90, 16))

        def forward(self, x, y):
            return linear_cross_entropy(x * 2, self.w, y, chunk_tokens=15, tile_elements=15 * 20,
                                        grad_in_forward=grad_in_forward)

    inputs = (torch.randn(100, 16), torch.randint(0, 90, (100,)))
    fast = estimate(Head(), inputs, loss_fn=lambda out, _: out)
    monkeypatch.setattr(api, "_FEWER_ITERATIONS", False)
    full = estimate(Head(), inputs, loss_fn=lambda out, _: out)
    assert fast.to_dict() == full.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
def test_meta_model_equals_real_model(patched):
    """A model built on the meta device (no memory at all) gives the real model's estimate; patched,
    its norms assume the default initialisation (as a freshly built real model has)."""
    real = _build("gpt2", layers=2, h=64)
    with torch.device("meta"):
        meta = _build("gpt2", layers=2, h=64)
    if patched:
        leanact.patch(real)
        leanact.patch(meta)
    assert next(meta.parameters()).is_meta
    a, b = estimate(real, _inputs(2, 32)), estimate(meta, _inputs(2, 32))
    assert a.to_dict() == b.to_dict()


@pytest.mark.slow
def test_cuda_model_rounds_to_blocks():
    """leanact's own ops keep the same on both devices; the plain model's dropout and SDPA follow
    CUDA's kernels (bool masks, fused attention: tests/test_estimate_cuda.py), which keep less."""
    model = leanact.patch(_build("gpt2", layers=2, h=64))
    cpu = estimate(model, _inputs(2, 32))
    cuda = estimate(model, _inputs(2, 32), device="cuda")
    assert cuda.peak % 512 == 0 and cuda.params % 512 == 0
    assert cuda.notes and not cpu.notes
    assert cuda.per_layer == cpu.per_layer  # kept bytes are the meter's exact storages
    plain = _build("gpt2", layers=2, h=64)
    plain_cpu, plain_cuda = estimate(plain, _inputs(2, 32)), estimate(plain, _inputs(2, 32), device="cuda")
    assert all(plain_cuda.per_layer[k] < v for k, v in plain_cpu.per_layer.items())


@pytest.mark.slow
def test_cuda_models_the_triton_kernels(monkeypatch):
    """device="cuda": leanact's ops allocate what their Triton kernels allocate (outputs only), so
    the peak is at most the PyTorch path's (LEANACT_TRITON=0) and what is kept is the same."""
    model = _build("bert", layers=2, h=64)  # dropout 0.1, GELU, LayerNorm
    leanact.patch(model)
    monkeypatch.delenv("LEANACT_TRITON", raising=False)  # the default: kernels on
    kernels = estimate(model, _inputs(2, 32), device="cuda")
    monkeypatch.setenv("LEANACT_TRITON", "0")
    torch_path = estimate(model, _inputs(2, 32), device="cuda")
    assert kernels.per_layer == torch_path.per_layer and kernels.saved == torch_path.saved
    assert kernels.peak <= torch_path.peak and kernels.temporaries < torch_path.temporaries


def test_table_and_dict():
    est = estimate(_build("llama", layers=2, h=64), _inputs(2, 32), optimizer="sgd")
    d = est.to_dict()
    assert d["peak"] == est.peak and d["optimizer_state"] == est.params  # SGD momentum: one buffer
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(est.table())
    assert "peak" in console.export_text()


def test_bad_inputs():
    model = _build("llama", layers=2, h=64)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_fn"):
        estimate(model.model, dict(input_ids=ids))
    with pytest.raises(TypeError, match="strategy_or_plan"):
        estimate(model, dict(input_ids=ids, labels=ids), strategy_or_plan=3)
    with pytest.raises(ValueError, match="optimizer"):
        estimate(model, dict(input_ids=ids, labels=ids), optimizer="adam9")
    with pytest.raises(ValueError, match="device"):
        estimate(model, dict(input_ids=ids, labels=ids), device="xpu")



@pytest.fixture
def fake_tensor_errors():
    """ERROR records of torch's fake-tensor logger (its own handler; it does not propagate)."""
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.slow
def test_bad_arguments_named_before_any_work(fake_tensor_errors):
    model = _build("gpt2", layers=1, h=64)  # 2*S learned positions
    x = dict(input_ids=torch.zeros(2, 8, dtype=torch.long), labels=torch.zeros(2, 8, dtype=torch.long))
    assert estimate(model, x, dtype="bf16").to_dict() == estimate(model, x, dtype=torch.bfloat16).to_dict()
    assert estimate(model, x, dtype="fp16").dtype == "float16" and estimate(model, x, dtype="FP32").dtype == "float32"
    cases = [(dict(dtype="fp8"), ValueError, "estimate(dtype='fp8'): use a floating torch.dtype"),
             (dict(dtype=torch.int64), ValueError, "estimate(dtype=torch.int64)"),
             (dict(dtype=16), TypeError, "estimate(dtype=16)"),
             (dict(batch=0), ValueError, "estimate(batch=0): batch must be a positive integer"),
             (dict(seq=-1), ValueError, "estimate(seq=-1)"), (dict(batch=2.0), TypeError, "estimate(batch=2.0)"),
             (dict(seq=2 * S + 1), ValueError, f"estimate(seq={2 * S + 1}): GPT2LMHeadModel has {2 * S} positions "
                                               f"(transformer.wpe); use seq={2 * S} or less")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=re.escape(message)) as info:
            estimate(model, x, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="BertForMaskedLM has 512 positions"):  # BERT's default table
        estimate_config(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=64, vocab_size=V), x, seq=513,
                        model_class=transformers.BertForMaskedLM)
    assert not fake_tensor_errors  # raised up front: no fake-tensor traceback logged
    assert estimate(model, x, seq=2 * S).per_layer  # the last position still fits


@pytest.mark.slow
def test_causal_lm_default_config_without_kv_cache():
    """A training step keeps no KV cache: use_cache=True (the default) and use_cache=False predict
    the same step, measure() agrees, and the user's configs are left as they were."""
    model = _build("llama", layers=2, h=64)
    x = _inputs(2, 32)
    assert model.config.use_cache
    for strategy in (None, "full"):
        default, off = estimate(model, x, strategy), estimate(model, dict(x, use_cache=False), strategy)
        assert default.to_dict() == off.to_dict() and model.config.use_cache
    assert measure(model, x).peak == estimate(model, x).peak and model.config.use_cache
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=172, vocab_size=V)
    built = estimate_config(cfg, x, model_class=transformers.LlamaForCausalLM)
    assert cfg.use_cache and built.activations == estimate(model, x).activations


def _has_strategies():
    try:
        import leanact.strategies  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_strategies(), reason="leanact.strategies not available")
def test_strategies_lean_and_full():
    """Full recompute keeps only each layer's input, so it keeps less; it lowers the step's peak
    only where activations, not gradients, set it. In backward, in the first layer (the last one
    back), all gradients but that layer's first ones and the embedding's exist and the layer's
    activations are all alive again: full holds there what lean holds, plus the layer input
    it checkpointed (b*s*h). At b=2, s=64 (h=128, bf16) a layer keeps 343,040 B under lean, less
    than its 363,008 B of gradients: lean's peak (start of backward, 8,444,528 B) is only 32,908 B
    above its level at that point, and full's peak (8,444,904 B) is that point, 33,284 B above
    lean's level there. At b=4 a layer keeps twice that, and full's peak is well below lean's."""
    model = leanact.patch(_build("llama", torch.bfloat16, h=128))
    inputs = dict(_inputs(B, S), use_cache=False)
    none, lean, full = (estimate(model, inputs, s) for s in (None, "lean", "full"))
    assert lean.per_layer == none.per_layer and lean.peak == none.peak
    # full recompute: a layer keeps only its input (= the previous layer's output, b*s*h bf16)
    assert full.per_layer_alive["model.layers.1"] == B * S * 128 * 2
    layer_grads = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
    assert lean.per_layer["model.layers.1"] > layer_grads  # activations dominate: the claim below holds
    assert full.activations < lean.activations and full.peak < lean.peak


@pytest.mark.slow
@pytest.mark.skipif(not _has_strategies(), reason="leanact.strategies not available")
def test_strategy_full_predicted_vs_measured():
    model = leanact.patch(_build("llama", torch.bfloat16, h=128))
    inputs = dict(_inputs(2, 64), use_cache=False)
    full = estimate(model, inputs, "full")
    real = measure(model, inputs, "full")
    assert full.per_layer_alive == real.per_layer_alive
    assert abs(full.peak - real.peak) / real.peak <= 0.05
    assert abs(full.activations - real.activations) / real.activations <= 0.05


class _Blocks(torch.nn.Module):
    """A plain (non-HF) model: a ModuleList of MLP blocks, tuple inputs, user loss."""

    def __init__(self, h=32, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(),
                                torch.nn.Linear(4 * h, h))
            for _ in range(n))

    def forward(self, x, scale):
        for blk in self.blocks:
            x = x + blk(x) * scale
        return x


def test_plain_model_tuple_inputs_and_loss_fn():
    model = _Blocks()
    x = (torch.randn(4, 16, 32), 0.5)
    loss_fn = lambda out, inputs: out.float().square().mean()  # noqa: E731
    pred = estimate(model, x, loss_fn=loss_fn, optimizer="sgd")
    real = measure(model, x, loss_fn=loss_fn, optimizer="sgd")
    assert pred.to_dict() | {"notes": []} == real.to_dict() | {"notes": []}
    assert list(pred.per_layer) == ["blocks.0", "blocks.1", "blocks.2"]
    # batch/seq resize the sample tensor (4, 16, 32) -> (8, 64, 32)
    big = estimate(model, x, loss_fn=loss_fn, optimizer="sgd", batch=8, seq=64)
    assert big.per_layer["blocks.1"] == 8 * pred.per_layer["blocks.1"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_protocol_releases_the_output(dtype):
    """Default: the output (logits) is released before backward, as HF Trainer does; keep_output=True
    holds it through backward: the peak differs by exactly the logits (the backward's peak is then)."""
    model = _build("llama", dtype, layers=2, h=64)
    x = _inputs(2, 32)
    trainer, held = estimate(model, x), estimate(model, x, keep_output=True)
    logits = 2 * 32 * V * dtype.itemsize
    assert held.peak - trainer.peak == logits
    assert held.activations - trainer.activations == logits
    real = measure(model, x, keep_output=True)
    assert real.peak == held.peak


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adamw_state_made_directly_equals_a_first_step(device, monkeypatch):
    """The built-in "adamw" state is made directly (no step on zero gradients): the same estimate, to
    the byte, as the state a first ``AdamW.step()`` makes; and the same state (keys, shapes, dtypes)."""
    import importlib

    step_mod = importlib.import_module("leanact.estimate.step")
    model = leanact.patch(_build("llama", torch.bfloat16, layers=2, h=64))
    x = _inputs(2, 32)
    direct = estimate(model, x, device=device)
    real_init = step_mod._init_optimizer
    monkeypatch.setattr(step_mod, "_init_optimizer", lambda opt, params, optimizer=None: real_init(opt, params))
    stepped = estimate(model, x, device=device)
    monkeypatch.undo()
    assert direct.to_dict() == stepped.to_dict()
    params = [p for p in model.parameters()]
    states = []
    for how in ("adamw", None):
        opt = step_mod.make_optimizer("adamw", params, foreach=True)
        step_mod._init_optimizer(opt, params, how)
        states.append({i: {k: (v.shape, v.dtype, v.device) for k, v in opt.state[p].items()}
                       for i, p in enumerate(params)})
        assert all(p.grad is None for p in params)
    assert states[0] == states[1]
