"""leanact.parallel on GPT-2 (fused q|k|v Conv1D c_attn, Conv1D projections) on 2 CPU ranks (gloo).

Each rank builds the same tiny GPT2LMHeadModel (same seed), keeps a single-process copy as the
reference, splits the other with ``leanact.parallel.parallelize`` and compares loss, logits and every
parameter gradient (fp32; DTensor gradients gathered with ``full_tensor()``), then one SGD step.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _dist import distributed_results  # noqa: E402

# slow: the first test waits for every module's distributed cases (tests/conftest.py)
# one xdist worker for every distributed module: one pair of gloo processes (tests/conftest.py)
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.xdist_group("distributed")]

TOL = 1e-5
H, HEADS = 64, 4


def build(dropout=0.0, patch=True, layers=2, cls="GPT2LMHeadModel", heads=HEADS, **kw):
    import leanact

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=H, n_layer=layers, n_head=heads, vocab_size=100, n_positions=64,
                                  bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0, **kw)
    model = getattr(transformers, cls)(cfg)
    with torch.no_grad():  # non-trivial norm weights and biases, and projection biases (HF: 1, 0, 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    # the default patch: with labels the LM head fuses the loss (logits compared in a label-free call)
    return (leanact.patch(model) if patch else model).train()


def batch(b=3, s=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s - 5:] = 0
    return dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a, b):
    return ((full(a) - b).norm() / b.norm().clamp_min(1e-6)).item()


def errors(pairs):
    """Relative error of each (parallel, reference) tensor; a reference that is 0 in exact arithmetic
    (the key part of c_attn's bias gradient: softmax ignores a per-row shift) is rounding noise, so
    near-zero references (below 1e-6 of the median norm) are measured against that median."""
    scale = torch.stack([r.norm() for _, r in pairs.values()]).median()
    return {k: ((full(p) - r).norm() / (r.norm() if r.norm() > 1e-6 * scale else scale)).item()
            for k, (p, r) in pairs.items()}


def _all_cases(rank, world, cases):
    kinds = {"memory": _memory_case, "layout": _layout_case, "base": _base_case, "errors": _errors_case}
    return {case: kinds[case[0]](world, *case[1:]) if case[0] in kinds else _tp_case(world, *case) for case in cases}


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _tp_case(world, sequence_parallel, dropout, patch=True, strategy=None):
    import leanact.parallel

    model = build(dropout, patch)
    ref = copy.deepcopy(model)
    par = leanact.parallel.parallelize(model, _mesh(world), sequence_parallel=sequence_parallel)
    if strategy is not None:  # recompute on top: gathers, reduce-scatters and the fused c_attn re-run
        import leanact.strategies

        leanact.strategies.uniform(par, strategy).apply(par)
    data = batch()
    torch.manual_seed(7)
    out_ref = ref(**data)
    out_ref.loss.backward()
    torch.manual_seed(7)
    out = par(**data)
    out.loss.backward()
    refs = dict(ref.named_parameters())
    grads = errors({n: (p.grad, refs[n].grad) for n, p in par.named_parameters()})
    for m in (ref, par):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    step = errors({n: (p.detach(), refs[n].detach()) for n, p in par.named_parameters()})
    # with labels a patched head fuses the loss and returns no logits; compare them without labels
    assert (out.logits is None) == (out_ref.logits is None) == patch, (out.logits is None, patch)
    with torch.no_grad():
        torch.manual_seed(7)
        logits_ref = ref.eval()(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
        logits = par.eval()(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    return dict(loss=rel(out.loss, out_ref.loss), logits=rel(logits, logits_ref), grads=grads, step=step,
                keys=list(par.state_dict()) == list(ref.state_dict()), rng=torch.get_rng_state())


def _base_case(world):
    """GPT2Model (no head), TP + SP: last hidden state and every gradient of a random projection of it."""
    import leanact.parallel

    model = build(cls="GPT2Model")
    ref = copy.deepcopy(model)
    par = leanact.parallel.parallelize(model, _mesh(world))
    data = {k: v for k, v in batch().items() if k != "labels"}
    w = torch.randn(H, generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (ref, par):
        out = m(**data).last_hidden_state
        (out @ w).square().mean().backward()
        outs.append(out)
    refs = dict(ref.named_parameters())
    return dict(out=rel(outs[1], outs[0]), grads=errors({n: (p.grad, refs[n].grad) for n, p in par.named_parameters()}))


def _errors_case(world):
    """Messages of the errors raised for GPT-2 models that cannot be split and for other model types."""
    import leanact.parallel

    out = {}
    for key, kw in {"heads": dict(heads=1), "cross": dict(add_cross_attention=True)}.items():
        try:
            leanact.parallel.parallelize(build(layers=1, **kw), _mesh(world))
        except ValueError as e:
            out[key] = str(e)
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64, vocab_size=100, word_embed_proj_dim=32))
    try:
        leanact.parallel.parallelize(opt, _mesh(world))
    except ValueError as e:
        out["opt"] = str(e)
    return out


def _layout_case(world):
    """This rank's local c_attn weight / bias, the attention's local sizes, the full c_attn weight
    against the single-process one, and the error of a bad (non-Conv1D) use of the Conv1D styles."""
    import leanact.parallel
    from leanact.parallel.gpt2 import Conv1DColwise

    model = build(layers=1)
    ref = copy.deepcopy(model)
    leanact.parallel.parallelize(model, _mesh(world))
    attn = model.transformer.h[0].attn
    try:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(torch.nn.Linear(4, 4), _mesh(world), Conv1DColwise())
        bad = ""
    except TypeError as e:
        bad = str(e)
    return dict(w=attn.c_attn.weight.to_local().clone(), b=attn.c_attn.bias.to_local().clone(),
                full_w=torch.equal(attn.c_attn.weight.full_tensor(), ref.transformer.h[0].attn.c_attn.weight),
                ref_w=ref.transformer.h[0].attn.c_attn.weight.detach().clone(),
                ref_b=ref.transformer.h[0].attn.c_attn.bias.detach().clone(),
                sizes=(attn.split_size, attn.num_heads, attn.head_dim), bad=bad)


def _memory_case(world, b, s):
    """Bytes kept per layer: single process (SavedTensorMeter) vs this rank (ShardedSavedTensorMeter)."""
    import leanact.parallel
    from leanact.memory import SavedTensorMeter
    from leanact.parallel.meter import ShardedSavedTensorMeter

    model = build()
    runs = {"ref": (copy.deepcopy(model), SavedTensorMeter),
            "sp": (leanact.parallel.parallelize(copy.deepcopy(model), _mesh(world)), ShardedSavedTensorMeter)}
    data = batch(b=b, s=s)
    out = {}
    for name, (m, Meter) in runs.items():
        meter = Meter(m)
        with meter:
            loss = m(**data).loss
        out[name] = meter.by_module(depth=3)
        loss.backward()
    return out


CASES = [(True, 0.0), (False, 0.0), (True, 0.1), (False, 0.1), (True, 0.0, False), (True, 0.1, True, "full"),
         ("memory", 2, 32), ("layout",), ("base",), ("errors",)]
EQUAL_CASES = [c for c in CASES if isinstance(c[0], bool)]


@pytest.fixture(scope="module")
def results(dist_results):
    """All cases in one pair of processes, shared with the other distributed test modules
    (tests/conftest.py: starting processes and importing transformers cost most of the time)."""
    return distributed_results(dist_results, __name__)


@pytest.mark.parametrize("case", EQUAL_CASES,
                         ids=lambda c: f"{'sp' if c[0] else 'tp'}-dropout{c[1]}"
                         + ("" if len(c) < 3 or c[2] else "-unpatched") + "".join(f"-{x}" for x in c[3:]))
def test_gpt2_matches_single_process(results, case):
    """TP (+SP) loss, logits, every gradient and the parameters after one SGD step equal the
    single-process model's (1e-5 relative); with dropout 0.1 too (embedding dropout replicated,
    residual dropouts on sequence shards draw the single-process mask's slice; attention dropout
    off: its masks are forked per rank, so they differ from the single process's by design)."""
    rs = [r[case] for r in results]
    for r in rs:
        assert r["loss"] < TOL and r["logits"] < TOL, r
        assert not {k: v for k, v in r["grads"].items() if v > TOL}
        assert not {k: v for k, v in r["step"].items() if v > TOL}
        assert r["keys"]  # state_dict keys unchanged
        assert len(r["grads"]) == 2 + 2 * 12 + 2  # wte, wpe, 12 per block, ln_f (lm_head tied)
    assert torch.equal(rs[0]["rng"], rs[1]["rng"])


def test_gpt2_model_without_head(results):
    """GPT2Model (the bare stack) splits too: output and every gradient equal the single process's."""
    for r in results:
        x = r[("base",)]
        assert x["out"] < TOL and not {k: v for k, v in x["grads"].items() if v > TOL}


def test_bad_input_errors(results):
    errors = results[0][("errors",)]
    assert "1 attention heads" in errors["heads"] and "tensor-parallel size 2" in errors["heads"]
    assert "cross-attention" in errors["cross"]
    assert "'opt' is not supported" in errors["opt"] and "'gpt2'" in errors["opt"]


def test_fused_qkv_layout(results):
    """Rank r holds [q_r | k_r | v_r] of c_attn (heads 2r, 2r+1 of each of q, k, v), and the
    attention module splits and shapes its local output with h/t, H/t."""
    t, d = 2, H // 2
    for r, res in enumerate(results):
        x = res[("layout",)]
        cols = torch.cat([torch.arange(j * H + r * d, j * H + (r + 1) * d) for j in range(3)])
        assert torch.equal(x["w"], x["ref_w"][:, cols]) and torch.equal(x["b"], x["ref_b"][cols])
        assert x["full_w"]
        assert x["sizes"] == (H // t, HEADS // t, H // HEADS)
        assert "Conv1D" in x["bad"] and "Linear" in x["bad"]


def test_per_rank_kept_bytes(results):
    """Per rank a GPT-2 block keeps exactly 1/t of the single-process lean block: ln_1/ln_2 outputs
    and rstd on s/t rows, q|k|v, attention output and statistics on H/t heads, GELU output and bits
    on 4h/t columns; c_attn and c_fc keep the s/t-row shard of their input (already kept by the
    norm) and re-gather it in backward. Block 0 also keeps the padding mask whole (built for the
    full sequence and shared with block 1)."""
    b, s, t = 2, 32, 2
    mask = b * s * s  # bool (b, 1, s, s)
    for r in results:
        m = r[("memory", b, s)]
        ref, par = m["ref"], m["sp"]
        l0, l1 = "transformer.h.0", "transformer.h.1"
        assert ref[l1] > 0 and ref[l0] == ref[l1] + mask
        assert par[l1] * t == ref[l1]
        assert par[l0] == ref[l1] // t + mask
