"""leanact.parallel.context_parallel (Ulysses): patched HF models on 2 and 4 CPU ranks (gloo).

Each rank builds the same model (same seed), keeps a single-process copy as the reference and
runs the other context-parallel on the same full batch: the loss (the global one, on every rank)
and every parameter gradient (averaged over the ranks) equal the single-process step's (fp32,
1e-5). Causal references run with ``use_cache=False``: transformers then keeps packed sequences
apart, as context parallelism always does.
"""
import copy
import math
import traceback
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _dist import distributed_results, spawn  # noqa: E402
from test_parallel_tp import grad_errors, rel  # noqa: E402

# slow: the first test waits for every module's distributed cases (tests/conftest.py)
# one xdist worker for every distributed module: one pair of gloo processes (tests/conftest.py)
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.xdist_group("distributed")]

TOL = 1e-5
V = 100


def build(family, *, heads=4, kv_heads=2, hidden=64, fused_loss=True, window=None, dropout=0.0, attn="sdpa"):
    import leanact

    torch.manual_seed(0)
    T = transformers
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=96,
                  vocab_size=V, max_position_embeddings=64, attn_implementation=attn)
    if family == "bert":
        model = T.BertForMaskedLM(T.BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                               **common))
    elif family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=heads, vocab_size=V, n_positions=64,
                                               resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                               attn_implementation="sdpa", loss_type="ForCausalLM"))
    else:
        cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
               "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM)}
        config_cls, model_cls = cls[family]
        extra = {"head_dim": 16} if family == "qwen3" else {}
        if family == "mistral":
            extra["sliding_window"] = window
        model = model_cls(config_cls(num_key_value_heads=kv_heads, attention_dropout=dropout, **extra, **common))
    with torch.no_grad():  # non-trivial norm weights and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return leanact.patch(model, fused_loss=fused_loss).train()


def batch(family, layout, b=2, s=16):
    """``layout``: "plain", "padding" (right padding in row 1, left padding in row 0 for causal
    models), "packed" (position_ids restarting inside each row, no attention mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (b, s), generator=g)
    out = dict(input_ids=ids)
    if layout == "padding":
        mask = torch.ones(b, s, dtype=torch.long)
        mask[1, s - 5:] = 0
        if family != "bert":
            mask[0, :3] = 0
        out["attention_mask"] = mask
    if layout == "packed":
        out["position_ids"] = torch.cat([torch.arange(5), torch.arange(s - 5)]).expand(b, s).clone()
        out["position_ids"][1] = torch.cat([torch.arange(11), torch.arange(s - 11)])
    if family == "bert":
        labels = torch.where(torch.rand(b, s, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, s // 2:] = -100  # the second rank's (of 2) tokens have no label at all
        labels[0, 0] = ids[0, 0]
    else:
        labels = ids.clone()
        if "attention_mask" in out:
            labels = labels.masked_fill(out["attention_mask"] == 0, -100)
    out["labels"] = labels
    return out


def _checkpointing(model, reentrant):
    """transformers' activation checkpointing."""
    with warnings.catch_warnings():  # (transformers 5.24 renames it; 5.17 has only this name)
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _ref_call(family, model, data, **kw):
    return model(**data, **kw) if family == "bert" else model(**data, use_cache=False, **kw)


def _compare(world, rank, family, layout, *, recompute=None, wrap=None, count=None, fused_loss=True, compile=None,
             **kw):
    import torch.distributed as dist

    import leanact.parallel

    model = build(family, fused_loss=fused_loss, **kw)
    ref = copy.deepcopy(model)
    data = batch(family, layout)
    extra = {} if count is None else {"num_items_in_batch": torch.tensor(count)}
    want = _ref_call(family, ref, data, **extra)
    want.loss.backward()
    if recompute in ("hf", "hf-reentrant"):
        _checkpointing(model, reentrant=recompute == "hf-reentrant")
    elif recompute is not None:
        import leanact.strategies

        leanact.strategies.uniform(model, recompute).apply(model)
    leanact.parallel.context_parallel(model)
    run = model
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
    elif wrap == "fsdp":  # weights, gradients and optimizer state sharded over the same ranks
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        run = fully_shard(model)
    if compile is not None:  # the whole context-parallel model (graph breaks at its host reads of the masks)
        torch._dynamo.reset()
        run = torch.compile(run, backend=compile)
    out = run(**data, **extra)
    out.loss.backward()
    if wrap is None:
        leanact.parallel.average_gradients(model)
    result = {"loss": rel(out.loss.detach(), want.loss.detach()), **grad_errors(model, ref)}
    if not fused_loss:  # this rank's logits: its slice of the single-process logits
        s = data["input_ids"].shape[1] // world
        result["logits"] = rel(out.logits.detach(), want.logits.detach()[:, rank * s:(rank + 1) * s])
    with torch.no_grad():  # evaluation: the global loss too
        model.eval(), ref.eval()
        result["eval_loss"] = rel(model(**data).loss, _ref_call(family, ref, data).loss)
    dist.barrier()
    return result


def _dropout(world, rank):
    """Dropout under context parallelism: inside the forward each rank draws from a generator seeded
    for that rank (read by a hook on a dropout module), after it the default generator is where it
    would be on every rank (restored: ranks stay in step); the masks are in effect (the training loss
    is not the eval one) and HF's recompute redraws the same ones (bitwise the same gradients)."""
    import torch.distributed as dist

    import leanact.parallel

    grads, seen = {}, {}
    data = batch("bert", "plain")
    for recompute in (False, True):
        model = build("bert", dropout=0.3)
        if recompute:
            _checkpointing(model, reentrant=False)
        leanact.parallel.context_parallel(model)
        dropout = next(m for m in model.modules() if isinstance(m, torch.nn.Dropout))
        dropout.register_forward_pre_hook(lambda *_: seen.setdefault(recompute, torch.initial_seed()) and None)
        torch.manual_seed(5)
        loss = model(**data).loss
        after = torch.get_rng_state().double().sum()
        loss.backward()
        grads[recompute] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        model.eval()
        eval_loss = model(**data).loss
    mine = torch.tensor([float(seen[False]), after.item()], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return {"recompute_same": torch.equal(grads[False], grads[True]), "active": bool(loss != eval_loss),
            "seeds": [e[0].item() for e in every], "after": [e[1].item() for e in every]}


def _errors(world, rank):
    import leanact.parallel

    errors = {}

    def catch(name, fn):
        try:
            fn()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)

    unpatched = build("llama")
    import leanact

    leanact.unpatch(unpatched)
    catch("unpatched", lambda: leanact.parallel.context_parallel(unpatched))
    catch("heads", lambda: leanact.parallel.context_parallel(build("llama", heads=3, kv_heads=3, hidden=48)))
    model = leanact.parallel.context_parallel(build("llama"))
    catch("twice", lambda: leanact.parallel.context_parallel(model))
    ids = torch.randint(0, V, (2, 15))
    catch("length", lambda: model(input_ids=ids))
    catch("mask4d", lambda: model(input_ids=ids[:, :14], attention_mask=torch.ones(2, 1, 14, 14)))
    catch("positional", lambda: model(ids[:, :14]))
    catch("positions", lambda: model(input_ids=ids[:, :14], position_ids=torch.arange(14)))
    leanact.unpatch(model)  # attention back to sdpa: each rank would attend to its own tokens only
    catch("unpatched_after", lambda: model(input_ids=ids[:, :14]))
    return errors


def _all(rank, world, cases):
    kinds = {"dropout": _dropout, "errors": _errors}
    out = {}
    for case in cases:  # one case's failure is reported to its own test (the ranks stay in step)
        name, *args = case
        try:
            if name in kinds:
                out[case] = kinds[name](world, rank, *args)
            else:
                family, layout, options = case
                out[case] = _compare(world, rank, family, layout, **dict(options))
        except Exception:
            out[case] = {"error": traceback.format_exc()}
    return out


def _result(results, case, rank=0):
    r = results[rank][case]
    if isinstance(r, dict) and "error" in r:
        pytest.fail(f"rank {rank}:\n{r['error']}")
    return r


CASES = [
    ("llama", "padding", ()), ("llama", "packed", ()),
    ("llama", "padding", (("fused_loss", False),)),
    ("llama", "padding", (("count", 40),)),
    ("llama", "padding", (("recompute", "hf"),)), ("llama", "packed", (("recompute", "hf-reentrant"),)),
    ("llama", "padding", (("recompute", "offload+recompute+tiled_mlp"),)),
    ("llama", "padding", (("wrap", "ddp"),)), ("llama", "packed", (("wrap", "fsdp"),)),
    ("llama", "packed", (("compile", "aot_eager"),)),
    ("qwen2", "padding", ()), ("qwen3", "packed", ()),
    ("mistral", "padding", (("window", 5),)),
    ("mistral", "padding", (("window", 5), ("attn", "eager"))),  # left-padded queries that see no key
    ("llama", "padding", (("attn", "eager"),)), ("mistral", "packed", (("window", 4),)),
    ("gpt2", "packed", ()),
    ("bert", "padding", (("fused_loss", False),)),
    ("dropout",), ("errors",),
]
COMPARED = [c for c in CASES if c[0] not in ("dropout", "errors")]


@pytest.fixture(scope="module")
def results(dist_results):
    return distributed_results(dist_results, __name__)


def _id(case):
    return "-".join([case[0], case[1]] + [f"{k}={v}" for k, v in case[2]])


@pytest.mark.parametrize("case", COMPARED, ids=_id)
def test_context_parallel_matches_single_process(results, case):
    for rank in range(len(results)):
        bad = {k: v for k, v in _result(results, case, rank).items() if v > TOL}
        assert not bad, (rank, bad)


@pytest.mark.parametrize("dtype,kv_heads,ranks", [(torch.float32, 4, 2), (torch.float32, 2, 4),
                                                   (torch.bfloat16, 4, 2)])
def test_each_rank_keeps_what_one_process_keeps_for_its_tokens(dtype, kv_heads, ranks):
    """Bytes kept for backward by one rank (a SimulatedGroup: the same tensors as a real rank's, no
    communication) = one process given that rank's tokens, positions and labels, plus what the
    exchange adds: where the attention kernel keeps its output (torch's SDPA: fp32 on the CPU), that
    output in the exchanged layout (the output projection keeps the other one: b·s/P·h per layer);
    where key/value heads are repeated to a multiple of P, the repeated copies."""
    import leanact.parallel
    from leanact.memory import SavedTensorMeter

    model = build("llama", kv_heads=kv_heads).to(dtype)
    single = copy.deepcopy(model)
    leanact.parallel.context_parallel(model, leanact.parallel.SimulatedGroup(ranks, rank=1))
    data = batch("llama", "plain")
    b, s = data["input_ids"].shape
    lo, hi = s // ranks, 2 * s // ranks
    shifted = torch.nn.functional.pad(data["labels"][:, 1:], (0, 1), value=-100)
    mine = shifted[:, lo:hi].contiguous()
    part = dict(input_ids=data["input_ids"][:, lo:hi], position_ids=torch.arange(s).expand(b, -1)[:, lo:hi],
                labels=mine, shift_labels=mine, num_items_in_batch=(shifted != -100).sum(), use_cache=False)
    kept = {}
    for name, m, d in (("rank", model, data), ("single", single, part)):
        with SavedTensorMeter(m) as meter:
            m(**d).loss.backward()
        kept[name] = meter.activation_bytes
    config, size = model.config, torch.empty((), dtype=dtype).element_size()
    tokens, layers, d = b * (hi - lo), config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    output = tokens * config.hidden_size * size if dtype == torch.float32 else 0
    repeat = ranks // math.gcd(kv_heads, ranks)
    repeated = 2 * (repeat - 1) * tokens * kv_heads * d * size
    assert kept["single"] > 0
    assert kept["rank"] - kept["single"] == layers * (output + repeated), kept


@pytest.mark.parametrize("layout", ["padding", "packed"])
def test_padded_or_packed_rank_keeps_ids_not_a_mask(layout):
    """A padded or packed batch adds the whole sequence's segment ids to what a rank keeps, once for
    every layer: b·2s int32, not a (b, 1, s, s) mask. (bf16: leanact's core in both, SDPA keeps its
    fp32 output on the CPU.)"""
    import leanact.parallel
    from leanact.memory import SavedTensorMeter

    kept = {}
    for name in ("plain", layout):
        model = leanact.parallel.context_parallel(build("llama").to(torch.bfloat16),
                                                  leanact.parallel.SimulatedGroup(2, rank=1))
        data = batch("llama", name)
        with SavedTensorMeter(model) as meter:
            model(**data).loss.backward()
        kept[name] = meter.activation_bytes
    b, s = data["input_ids"].shape
    assert kept[layout] - kept["plain"] == b * 2 * s * 4, kept


def test_dropout_differs_across_ranks_and_recompute_redraws_it(results):
    for rank in range(len(results)):
        r = _result(results, ("dropout",), rank)
        assert r["recompute_same"] and r["active"]
    r = _result(results, ("dropout",))
    assert len(set(r["seeds"])) == len(r["seeds"])  # each rank its own generator inside the forward
    assert len(set(r["after"])) == 1  # and the same default generator on every rank after it


def test_bad_input_errors(results):
    errors = _result(results, ("errors",))
    assert "patch the model first" in errors["unpatched"]
    assert "3 attention heads do not divide by the group size 2" in errors["heads"]
    assert "already context-parallel" in errors["twice"]
    assert "sequence length 15 does not divide by the group size 2" in errors["length"]
    assert "(batch, seq) padding" in errors["mask4d"]
    assert errors["positional"] is None  # input_ids by position works too
    assert "give position_ids as (batch or 1, seq)" in errors["positions"]
    assert "attention is 'sdpa' now, not leanact's" in errors["unpatched_after"]


def _four(rank, world):
    return {case: _compare(world, rank, *case[:2], **dict(case[2])) for case in FOUR}


FOUR = [("llama", "packed", (("kv_heads", 1),)), ("bert", "padding", ())]


def test_four_ranks_match_single_process():
    """4 ranks: a key/value head repeated to 4 before the exchange; BERT's masked LM."""
    results = spawn(_four, world_size=4, timeout=300)
    for rank, r in enumerate(results):
        for case, errs in r.items():
            bad = {k: v for k, v in errs.items() if v > TOL}
            assert not bad, (rank, case, bad)


def test_unsupported_family_is_refused():
    import leanact
    import leanact.parallel.context as context

    model = leanact.patch(transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=V)))
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported"):
        context._check(model, 2)


def test_estimate_predicts_one_rank():
    """leanact.estimate(..., context_parallel=P): the bytes one rank keeps, predicted on fake tensors,
    match a rank's run (a SimulatedGroup on real tensors) within 1%; plan(maximize="seq") takes it."""
    import leanact
    import leanact.parallel
    from leanact.memory import SavedTensorMeter

    model = build("llama")
    data = batch("llama", "plain")
    predicted = leanact.estimate(model, data, None, "cpu", context_parallel=2)
    rank = leanact.parallel.context_parallel(copy.deepcopy(model), leanact.parallel.SimulatedGroup(2))
    with SavedTensorMeter(rank) as meter:
        rank(**data).loss.backward()
    assert abs(predicted.saved - meter.activation_bytes) <= 0.01 * meter.activation_bytes
    with pytest.raises(ValueError, match="context_parallel must be a number of ranks"):
        leanact.estimate(model, data, None, "cpu", context_parallel=0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
                                      vocab_size=V, max_position_embeddings=1 << 16)
    long = leanact.patch(transformers.LlamaForCausalLM(config))
    ids = torch.zeros(1, 128, dtype=torch.long)
    found = {p: leanact.plan(long, dict(input_ids=ids, labels=ids), "24MiB", maximize="seq", device="cpu",
                             strategies=["lean"], context_parallel=p).maximized.value for p in (None, 4)}
    assert found[4] > 2 * found[None] > 0, found
