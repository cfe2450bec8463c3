"""Strategy "tiled_mlp" (leanact.strategies.tiled): the MLP over chunks of the sequence, each chunk
recomputed in backward. Same loss and gradients as the lean layer (fp32, 1e-5; the chunks change
only the matmul shapes), none of the MLP's inside kept (asserted to the byte), the model's own
forward back after remove()."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import _families as F
import leanact
from leanact import strategies as S
from leanact.memory import SavedTensorMeter


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _step(m, batch):
    m.zero_grad(set_to_none=True)
    out = m(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, patched", [("llama", True), ("llama", False), ("gpt2", True), ("bert", True)],
                         ids=["llama-patched", "llama-unpatched", "gpt2-patched", "bert-patched"])
def test_tiled_mlp_matches_lean(family, patched):
    ref = F.build(family)
    if patched:
        ref = leanact.patch(ref)
    tiled = copy.deepcopy(ref)
    S.uniform(tiled, "tiled_mlp", mlp_chunk=3).apply(tiled)  # S = 10: chunks of 3, 3, 3, 1
    batch = F.batch(family, "right")
    la, ga = _step(ref, batch)
    lb, gb = _step(tiled, batch)
    assert abs(lb - la) <= 1e-5 * abs(la)
    median = torch.stack([g.norm() for g in ga.values()]).median()
    for n, g in ga.items():
        assert (gb[n] - g).norm() <= max(1e-5 * g.norm(), 1e-6 * median), n
    with torch.no_grad():
        ref.eval(), tiled.eval()
        assert torch.equal(ref(**batch).loss, tiled(**batch).loss)


def test_kept_bytes_none_of_the_mlp():
    """Patched LLaMA: the lean SwiGLU MLP keeps g = gate(x) and u = up(x) (its input x is the norm's
    output, kept by the norm); tiled, it keeps nothing: exactly 2·I·4 bytes per token per layer less."""
    m = leanact.patch(F.build("llama"))
    batch = F.batch("llama")
    kept = []
    for strategy in ("lean", "tiled_mlp"):
        S.uniform(m, strategy, mlp_chunk=4).apply(m)
        meter = SavedTensorMeter(m, exclude=list(batch.values()))
        with meter:
            loss = m(**batch).loss
        kept.append(meter.total_bytes)
        loss.backward()
        S.remove(m)
    tokens = batch["input_ids"].numel()
    cfg = m.config
    assert kept[0] - kept[1] == cfg.num_hidden_layers * 2 * cfg.intermediate_size * 4 * tokens


def test_apply_and_remove():
    m = F.build("llama")
    mlp = m.model.layers[0].mlp
    plan = S.uniform(m, "tiled_mlp", mlp_chunk=4)
    plan.apply(m)
    plan.apply(m)  # replaces, never wraps twice
    assert isinstance(mlp.__dict__["forward"], S.tiled.TiledMLP) and mlp.__dict__["forward"].original.__self__ is mlp
    S.remove(m)
    assert "forward" not in mlp.__dict__
    bert = F.build("bert")
    S.uniform(bert, "tiled_mlp").apply(bert)
    assert "feed_forward_chunk" in bert.bert.encoder.layer[0].__dict__
    S.remove(bert)
    assert "feed_forward_chunk" not in bert.bert.encoder.layer[0].__dict__
