"""leanact.parallel: tensor + sequence parallelism of patched HF BERT and LLaMA on 2 CPU ranks (gloo).

Each rank builds the same model (same seed), keeps a single-process copy as the reference, splits
the other with ``leanact.parallel.parallelize`` and compares output, loss and every parameter
gradient (fp32; DTensor gradients gathered with ``full_tensor()``).
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


def build(family, dropout=0.0, attn_dropout=0.0, layers=2, patch=True):
    import leanact

    torch.manual_seed(0)
    T = transformers
    if family == "bert":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                           vocab_size=100, max_position_embeddings=64, attn_implementation="sdpa",
                           hidden_dropout_prob=dropout, attention_probs_dropout_prob=attn_dropout)
        model = T.BertForMaskedLM(cfg)
    elif family == "llama":
        cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=100, max_position_embeddings=64,
                            attn_implementation="sdpa", attention_dropout=attn_dropout)
        model = T.LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():  # non-trivial norm weights and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    # fused_loss=False: these tests compare the logits too (the fused loss returns none)
    return (leanact.patch(model, fused_loss=False) if patch else model).train()


def batch(family, b=3, s=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, s - 5:] = 0
    if family == "llama":
        return dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)
    labels = torch.where(torch.rand(b, s, generator=g) < 0.4, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a, b):
    return ((full(a) - b).norm() / b.norm().clamp_min(1e-6)).item()


def grad_errors(par, ref):
    """Relative error of every gradient. Gradients that are 0 in exact arithmetic (key biases:
    softmax is invariant to a per-row shift) are rounding noise on both sides; for those (norm
    below 1e-6 of the median gradient norm) the error is measured against that median instead."""
    refs = dict(ref.named_parameters())
    scale = torch.stack([p.grad.norm() for p in refs.values()]).median()
    out = {}
    for name, p in par.named_parameters():
        assert p.grad is not None, name
        g_ref = refs[name].grad
        if g_ref.norm() < 1e-6 * scale:
            out[name] = ((full(p.grad) - g_ref).norm() / scale).item()
        else:
            out[name] = rel(p.grad, g_ref)
    assert set(out) == set(refs)
    return out


def _all_cases(rank, world, cases):
    kinds = {"memory": _memory_case, "rng": _rng_case, "errors": _errors_case}
    return {case: kinds[case[0]](world, *case[1:]) if case[0] in kinds else _tp_case(world, *case) for case in cases}


def _errors_case(world):
    """Messages of the errors parallelize raises for bad input."""
    from torch.distributed.device_mesh import init_device_mesh

    import leanact.parallel

    mesh = init_device_mesh("cpu", (world,))
    out = {}

    def catch(key, fn):
        try:
            fn()
        except ValueError as e:
            out[key] = str(e)

    torch.manual_seed(0)
    three_heads = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=48, num_attention_heads=3, intermediate_size=64, num_hidden_layers=1, vocab_size=100))
    catch("heads", lambda: leanact.parallel.parallelize(three_heads, mesh))
    catch("plain", lambda: leanact.parallel.parallelize(torch.nn.Linear(2, 2), mesh))
    model = leanact.parallel.parallelize(build("bert", layers=1), mesh)
    catch("odd", lambda: model(**batch("bert", s=13)))
    catch("twice", lambda: leanact.parallel.parallelize(model, mesh))
    return out


def _rng_case(world):
    """Inside a tensor-parallel attention with dropout the ranks draw different seeds; outside,
    their generators stay equal. Returns (seed drawn inside, generator state after, per rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    import leanact.parallel
    from leanact.ops.random import draw_seed

    model = build("bert", attn_dropout=0.5, layers=1)
    leanact.parallel.parallelize(model, init_device_mesh("cpu", (world,)))
    attention = model.bert.encoder.layer[0].attention.self
    inside = []
    # a pre-hook registered after parallelize's runs inside the fork (hooks run in registration order)
    attention.register_forward_pre_hook(lambda m, a: inside.append((m.training, int(draw_seed()))))
    torch.manual_seed(3)
    model(**batch("bert")).loss.backward()
    model.eval()
    model(**batch("bert"))  # eval: no dropout, no fork
    return inside, torch.get_rng_state(), int(draw_seed())


def _memory_case(world, b, s):
    """Bytes kept per layer: single process (SavedTensorMeter) vs this rank (ShardedSavedTensorMeter),
    with and without re-gathering the column-parallel linears' inputs in backward."""
    from torch.distributed.device_mesh import init_device_mesh

    import leanact.parallel
    from leanact.memory import SavedTensorMeter
    from leanact.parallel.meter import ShardedSavedTensorMeter

    mesh = init_device_mesh("cpu", (world,))
    model = build("bert")
    runs = {"ref": (copy.deepcopy(model), SavedTensorMeter)}
    for regather in (True, False):
        par = leanact.parallel.parallelize(copy.deepcopy(model), mesh, regather=regather)
        runs[f"regather={regather}"] = (par, ShardedSavedTensorMeter)
    data = batch("bert", b=b, s=s)
    out = {}
    for name, (m, Meter) in runs.items():
        meter = Meter(m)
        with meter:
            loss = m(**data).loss
        out[name] = meter.by_module(depth=4)
        loss.backward()
    return out


def _tp_case(world, family, sequence_parallel, dropout, strategy=None, regather=True):
    from torch.distributed.device_mesh import init_device_mesh

    import leanact.parallel

    patch = not family.endswith("-unpatched")
    family = family.removesuffix("-unpatched")
    model = build(family, dropout=dropout, patch=patch)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    par = leanact.parallel.parallelize(model, mesh, sequence_parallel=sequence_parallel, regather=regather)
    if strategy is not None:  # recompute on top: the gathers and reduce-scatters re-run in backward
        import leanact.strategies

        leanact.strategies.uniform(par, strategy).apply(par)
    data = batch(family)
    torch.manual_seed(7)
    out_ref = ref(**data)
    out_ref.loss.backward()
    torch.manual_seed(7)
    out = par(**data)
    out.loss.backward()
    grads = grad_errors(par, ref)
    # One SGD step: the norms' Partial() gradients are reduced by the optimizer's DTensor ops.
    for m in (ref, par):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    refs = {n: p.detach() for n, p in ref.named_parameters()}
    scale = torch.stack([p.norm() for p in refs.values()]).median()
    step = {n: ((full(p.detach()) - refs[n]).norm()
                / (refs[n].norm() if refs[n].norm() > 1e-6 * scale else scale)).item()
            for n, p in par.named_parameters()}  # key biases start at 0 and get rounding-noise gradients
    return dict(loss=rel(out.loss, out_ref.loss), logits=rel(out.logits, out_ref.logits),
                grads=grads, step=step, rng=torch.get_rng_state())


CASES = [("bert", True, 0.0), ("bert", False, 0.0), ("llama", True, 0.0), ("llama", False, 0.0),
         ("bert", True, 0.1), ("memory", 2, 32), ("rng",), ("errors",),
         ("bert", True, 0.0, "full"), ("llama", True, 0.0, "full"), ("bert", True, 0.0, None, False),
         ("bert-unpatched", True, 0.0), ("bert", True, 0.1, "full")]
EQUAL_CASES = [c for c in CASES if c[0] not in ("memory", "rng", "errors")]


@pytest.fixture(scope="module")
def tp_results(dist_results):
    """All cases in one pair of processes, shared with the other distributed test modules
    (tests/conftest.py: starting processes and importing transformers cost most of the time)."""
    return distributed_results(dist_results, __name__)


@pytest.mark.parametrize("case", EQUAL_CASES,
                         ids=lambda c: f"{c[0]}-{'sp' if c[1] else 'tp'}-dropout{c[2]}"
                         + "".join(f"-{x}" for x in c[3:]))
def test_tp_matches_single_process(tp_results, case):
    """TP (+SP) output, loss and every gradient equal the single-process model's (1e-5 relative).
    With hidden dropout 0.1 too: the sequence-parallel dropout draws the single-process mask's slice."""
    results = [r[case] for r in tp_results]
    for r in results:
        assert r["loss"] < TOL and r["logits"] < TOL, r
        bad = {k: v for k, v in r["grads"].items() if v > TOL}
        assert not bad, bad
        bad = {k: v for k, v in r["step"].items() if v > TOL}  # parameters after one SGD step
        assert not bad, bad
    assert torch.equal(results[0]["rng"], results[1]["rng"])  # the ranks' generators stay in step


def test_per_rank_kept_bytes(tp_results):
    """Per rank, a BERT layer keeps exactly 1/t of the single-process bytes: everything is sequence-
    or head-sharded (norm outputs and rstd, attention q/k/v/output/statistics, GELU output and bits,
    dropout seeds), and the column-parallel linears keep the s/t-row shard of their input (already
    kept by the norm before them) and re-gather it in backward. Layer 0 also keeps the attention
    mask whole (built for the full sequence; layer 1 shares it) and its own input shard (the split
    of the replicated embeddings output is a new buffer). Without re-gathering the linears of q/k/v
    and fc1 keep the full-sequence input: + 2 * 4 bytes * b*s*h per layer (fp32)."""
    b, s, h, t = 2, 32, 64, 2
    mask = b * s * s  # bool (b, 1, s, s)
    for r in tp_results:
        m = r[("memory", b, s)]
        ref, par, par_full = m["ref"], m["regather=True"], m["regather=False"]
        l0, l1 = "bert.encoder.layer.0", "bert.encoder.layer.1"
        assert ref[l0] == 135680 and ref[l1] == ref[l0] - mask  # lean LayerNorms, attention, GELU
        assert par[l1] * t == ref[l1]
        assert par[l0] == (ref[l0] - mask) // t + mask + b * s // t * h * 4
        assert par_full[l1] == ref[l1] // t + 2 * b * s * h * 4
        assert par["bert.embeddings.LayerNorm"] == ref["bert.embeddings.LayerNorm"]  # replicated region


def test_attention_dropout_masks_differ_across_ranks(tp_results):
    """Heads are split across ranks: the attention's dropout draws from a generator forked per rank
    (Megatron's model-parallel RNG), so masks differ; the default generators stay in step."""
    (in0, state0, after0), (in1, state1, after1) = (r[("rng",)] for r in tp_results)
    assert [t for t, _ in in0] == [t for t, _ in in1] == [True, False]
    assert in0[0][1] != in1[0][1]  # training: forked per rank
    assert in0[1][1] == in1[1][1]  # eval (no dropout): not forked
    assert torch.equal(state0, state1) and after0 == after1


def test_bad_input_errors(tp_results):
    errors = tp_results[0][("errors",)]
    assert "3 attention heads" in errors["heads"] and "tensor-parallel size 2" in errors["heads"]
    assert "needs a Hugging Face model" in errors["plain"] and "Linear" in errors["plain"]
    assert "sequence length 13 does not divide" in errors["odd"] and "pad" in errors["odd"]
    assert "already parallelized" in errors["twice"]
