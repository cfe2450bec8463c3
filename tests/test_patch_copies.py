"""Copies and saving of patched models: ``copy.deepcopy`` (EMA, a DPO reference), pickle, and
``torch.save(model)`` / ``torch.load(weights_only=False)`` in a fresh process.

The LLaMA family's lean RMSNorm and SwiGLU MLP are classes created at run time (``LeanLlamaMLP``
derives from the HF class): pickle could not find them by name (``Can't pickle LeanLlamaMLP``).
They pickle by reference to the mixin and the HF class and are rebuilt on load. Module
replacements only: the models here are patched with ``attention=False`` (the attention state is
covered with the attention tests), but for one BERT patched with attention in the fresh-process test.
"""
import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import leanact

from _tiny import tiny_batch, tiny_hf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["bert", "llama"]


def _build(family):
    return leanact.patch(tiny_hf(family), attention=False)


def _classes(model):
    return {name: f"{type(m).__module__}.{type(m).__name__}" for name, m in model.named_modules()}


def _lean_classes(model):
    return {k: v for k, v in _classes(model).items() if v.startswith("leanact.")}


def _run(model):
    model.zero_grad()
    loss = model(**tiny_batch()).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _assert_same_run(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def _expected_lean(family):
    if family == "llama":
        return {"LeanLlamaMLP", "LeanLlamaRMSNorm"}
    # (+ the sub-layer ends, and the word embedding: tied to the MLM head's decoder)
    return {"LayerNorm", "PatchedGELU", "Dropout", "LeanBertSelfOutput", "LeanBertOutput", "LeanEmbedding"}


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("family", FAMILIES)
def test_copy_keeps_the_replacements(family, how):
    model = _build(family)
    lean = _lean_classes(model)
    assert {c.rsplit(".", 1)[1] for c in lean.values()} == _expected_lean(family)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert _classes(twin) == _classes(model)
    assert not {id(p) for p in twin.parameters()} & {id(p) for p in model.parameters()}
    _assert_same_run(_run(twin), _run(model))
    # the copy is patched on its own: unpatching it restores HF's classes there only
    leanact.unpatch(twin)
    assert not _lean_classes(twin)
    assert _lean_classes(model) == lean


@pytest.mark.slow
def test_torch_load_in_a_fresh_process(tmp_path):
    """torch.save in this process, torch.load(weights_only=False) in a new one (where no Lean* class
    exists until unpickling creates it): same classes, same loss and gradients; with leanact's
    attention too (the config keeps the "leanact" implementation). One process for all models."""
    models = {family: _build(family) for family in FAMILIES}
    models["bert-attention"] = leanact.patch(tiny_hf("bert"))  # attention="recompute"
    for name, model in models.items():
        torch.save(model, tmp_path / f"{name}.pt")
        loss, grads = _run(model)
        torch.save({"classes": _classes(model), "loss": loss, "grads": grads, "batch": tiny_batch(),
                    "attention": model.config._attn_implementation}, tmp_path / f"{name}.ref.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.modules.pop("leanact", None)
        torch.set_num_threads({torch.get_num_threads()})  # (bitwise: the same reductions as this process)
        for family in {list(models)!r}:
            model = torch.load(r"{tmp_path}/" + family + ".pt", weights_only=False)
            ref = torch.load(r"{tmp_path}/" + family + ".ref.pt", weights_only=False)
            classes = {{n: f"{{type(m).__module__}}.{{type(m).__name__}}" for n, m in model.named_modules()}}
            assert classes == ref["classes"], (family, set(classes.items()) ^ set(ref["classes"].items()))
            assert model.config._attn_implementation == ref["attention"], family
            loss = model(**ref["batch"]).loss
            loss.backward()
            assert torch.equal(loss.detach(), ref["loss"]), family
            for k, p in model.named_parameters():
                assert torch.equal(p.grad, ref["grads"][k]), (family, k)
            import leanact
            leanact.unpatch(model)
            assert not [n for n, m in model.named_modules() if type(m).__module__.startswith("leanact.")], family
        print("fresh process OK")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fresh process OK" in out.stdout
