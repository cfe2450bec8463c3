"""save_pretrained on a patched model -> from_pretrained into a fresh, unpatched model."""
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from leanact.patching import patch  # noqa: E402

from test_patch_families import _batch, _build  # noqa: E402

FAMILIES = ["bert", "roberta", "gpt2", "vit"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_save_patched_load_unpatched(family, attn, tmp_path):
    ref = _build(family, attn).eval()
    lean = patch(_build(family, attn))
    lean.save_pretrained(tmp_path)
    assert lean.config._attn_implementation == "leanact"  # saving leaves the patched model as it was

    text = (tmp_path / "config.json").read_text()
    assert "leanact" not in text
    saved = json.loads(text)
    # transformers does not save the attention implementation at all: the loader picks its own.
    assert "_attn_implementation" not in saved and "attn_implementation" not in saved

    loaded = type(ref).from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation in ("sdpa", "eager")
    assert not hasattr(loaded, "_leanact_patch")
    sd_ref, sd_loaded = ref.state_dict(), loaded.state_dict()
    assert list(sd_loaded) == list(sd_ref)
    for k in sd_ref:
        assert torch.equal(sd_loaded[k], sd_ref[k]), k

    batch = _batch(family)
    with torch.no_grad():
        loaded.set_attn_implementation(attn)
        lean.eval()
        a, b, c = ref(**batch), loaded(**batch), lean(**batch)
    assert torch.equal(b.logits, a.logits)
    assert torch.equal(c.logits, a.logits)


@pytest.mark.slow
def test_saved_config_loads_without_leanact(tmp_path):
    """A fresh interpreter that never imports leanact (and has no "leanact" attention registered)
    loads the patched model's checkpoint and runs it."""
    lean = patch(_build("bert"))
    lean.save_pretrained(tmp_path)
    code = (
        "import sys, torch, transformers\n"
        f"m = transformers.BertForMaskedLM.from_pretrained({str(tmp_path)!r}).eval()\n"
        "assert 'leanact' not in sys.modules, 'leanact was imported'\n"
        "with torch.no_grad(): m(input_ids=torch.tensor([[5, 6, 7]]))\n"
        "print('impl', m.config._attn_implementation)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "impl sdpa" in r.stdout or "impl eager" in r.stdout, r.stdout
