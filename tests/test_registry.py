"""The registry of family adapters: what patch walks, the families it claims, and undoing it."""
import pathlib
import re

import pytest
import torch

pytest.importorskip("transformers")

import leanact  # noqa: E402
from leanact.patching import registry  # noqa: E402
from leanact.patching.adapter import ATTR, ModelStep  # noqa: E402

import _families as F  # noqa: E402

README = pathlib.Path(__file__).parent.parent / "README.md"


def _table_rows() -> list[str]:
    text = README.read_text()
    table = text[text.index("## Supported models"):text.index("## Limits")]
    return [line.split("|")[1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]


def _build(family: str):
    """The family's tiny model with an attention implementation it takes (None: this transformers lacks it)."""
    for attn in ("sdpa", "eager"):  # (Bloom, Gemma 2, GPT-OSS: no sdpa path; Falcon: no eager one)
        try:
            return F.build(family, attn)
        except F.Unsupported:
            continue
    return None


def test_every_claimed_family_is_in_the_matrix_and_every_tested_family_is_claimed():
    tested = {}
    for family in F.FAMILIES:
        if (model := _build(family)) is not None:
            tested.setdefault(model.config.model_type, family)
    claimed = set(registry.FAMILIES)
    assert set(tested) <= claimed, f"tested but not in registry.FAMILIES: {set(tested) - claimed}"
    assert claimed <= set(tested), f"in registry.FAMILIES but not in tests/_families.py: {claimed - set(tested)}"


def test_the_readme_table_names_every_family():
    rows = " ".join(_table_rows())
    missing = [name for name in registry.FAMILIES.values() if not re.search(rf"(^|[ ,(]){re.escape(name)}($|[ ,)])",
                                                                            rows)]
    assert not missing, f"README's supported-models table lacks {missing}"


def test_the_docs_count_the_families_of_the_registry():
    n = len(registry.FAMILIES)
    for doc in (README, README.parent / "docs" / "design.md"):
        counts = re.findall(r"differential matrix.{0,40}?(\d+) families", doc.read_text(), re.S)
        assert counts and all(int(c) == n for c in counts), f"{doc.name} counts {counts} families; the registry has {n}"


def test_adapters_and_steps_are_named_once():
    names = [a.name for a in registry.MODULE_ADAPTERS]
    steps = [s.name for s in registry.MODEL_STEPS]
    assert len(set(names)) == len(names) and len(set(steps)) == len(steps)
    assert steps[0] == "modules" and all(a.covers for a in registry.MODULE_ADAPTERS)


@pytest.mark.parametrize("family", ["llama", "bert", "gpt_oss", "clip", "falcon"])
def test_every_adapter_a_family_uses_is_undone(family):
    model = _build(family)
    before = {n: (type(m), id(m)) for n, m in model.named_modules()}
    leanact.patch(model)
    run = model.__dict__[ATTR]
    assert run.installed == [s.name for s in registry.MODEL_STEPS]
    assert run.swaps, "the family's modules were swapped"
    leanact.unpatch(model)
    assert {n: (type(m), id(m)) for n, m in model.named_modules()} == before
    assert ATTR not in model.__dict__


class _Stop(BaseException):
    pass


@pytest.mark.parametrize("stop_at", ["attention", "fused_loss", "cast_recipes"])
def test_a_patch_stopped_midway_leaves_the_model_as_it_was(monkeypatch, stop_at):
    """An error or an interrupt inside a step: the steps that ran are undone, the others never ran."""
    model = F.build("llama")
    before = {n: (type(m), id(m)) for n, m in model.named_modules()}
    impl = model.config._attn_implementation
    forward = model.__dict__.get("forward")

    def stop(model, run):
        raise _Stop

    steps = tuple(ModelStep(s.name, stop, s.uninstall) if s.name == stop_at else s for s in registry.MODEL_STEPS)
    monkeypatch.setattr("leanact.patching.MODEL_STEPS", steps)
    with pytest.raises(_Stop):
        leanact.patch(model)
    assert {n: (type(m), id(m)) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation == impl and model.__dict__.get("forward") is forward
    assert ATTR not in model.__dict__ and leanact.summary(model) is None
    batch = F.batch("llama")
    torch.manual_seed(0)
    model(**batch).loss.backward()  # the model still trains as it did
