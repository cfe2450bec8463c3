"""benchmarks/convergence.py in miniature: the shipped text and its provenance, deterministic
batches, and short trainings of a tiny BERT (MLM) and GPT-2 (causal LM), unpatched vs patched."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import leanact  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("leanact_bench_convergence", ROOT / "benchmarks" / "convergence.py")
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)

TINY = dict(size="tiny", batch=8, seq=32, eval_every=5, eval_batches=2)
STEPS = 25


def test_text_loads_with_its_provenance():
    text = conv.load_text()
    assert text.lstrip().startswith("ALICE'S ADVENTURES IN WONDERLAND")
    assert text.rstrip().endswith("THE END") and len(text) == 148476
    assert "\r" not in text and "Gutenberg" not in text  # no licence boilerplate to strip
    readme = (conv.DATA_DIR / "README.md").read_text()
    for fact in ("brotli 1.2.1", "Lewis Carroll", "public domain", conv.TEXT_SHA256, "alice29.txt"):
        assert fact in readme, fact
    train, held_out = conv.token_ids("train"), conv.token_ids("eval")
    assert len(train) + len(held_out) == len(text) and int(train.max()) < conv.MASK_ID


def test_batches_are_deterministic_and_held_out_is_separate():
    for task in conv.TASKS:
        a = conv.make_batches(task, "train", 3, 4, 8, 32)
        b = conv.make_batches(task, "train", 3, 4, 8, 32)
        c = conv.make_batches(task, "train", 4, 4, 8, 32)
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
        assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    # Every held-out window is a substring of the held-out part, which the training part precedes.
    text = conv.load_text()
    cut = len(conv.token_ids("train"))
    window = bytes(conv.make_batches("clm", "eval", 0, 1, 1, 200)[0]["input_ids"][0].tolist()).decode()
    assert text.find(window, cut) >= cut
    mlm = conv.make_batches("mlm", "train", 0, 8, 8, 32)
    picked = torch.cat([(b["labels"] != -100).flatten() for b in mlm]).float().mean().item()
    masked = torch.cat([(b["input_ids"] == conv.MASK_ID).flatten() for b in mlm]).float().mean().item()
    assert 0.1 < picked < 0.2 and 0.7 * picked < masked < 0.9 * picked


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="task must be one of"):
        conv.train_losses("seq2seq", None, 0, 2)
    with pytest.raises(ValueError, match="size must be one of"):
        conv.train_losses("mlm", None, 0, 2, size="huge")
    with pytest.raises(ValueError, match="seq must be in"):
        conv.make_batches("clm", "eval", 0, 1, 1, 10**7)


def _patched(record):
    def prepare(model):
        record.append(leanact.patch(model))
        return model
    return prepare


@pytest.mark.slow
@pytest.mark.parametrize("task", conv.TASKS)
def test_without_dropout_patched_training_matches_unpatched(task):
    record = []
    ref = conv.train_losses(task, None, 0, STEPS, dropout=0.0, **TINY)
    lean = conv.train_losses(task, _patched(record), 0, STEPS, dropout=0.0, **TINY)
    summary = leanact.patching.summary(record[0])
    assert summary.replaced and any("leanact" in after for _, _, after in summary.attention)
    assert lean["eval"][0] == ref["eval"][0]  # identical weights, identical held-out batches
    train_ref, train_lean = torch.tensor(ref["train"]), torch.tensor(lean["train"])
    torch.testing.assert_close(train_lean, train_ref, rtol=1e-6, atol=0)  # ~1e-7 seen
    torch.testing.assert_close(torch.tensor([loss for _, loss in lean["eval"]]),
                               torch.tensor([loss for _, loss in ref["eval"]]), rtol=1e-6, atol=0)
    assert [s for s, _ in ref["eval"]] == [0, 5, 10, 15, 20, 25]
    assert ref["final_eval"] < ref["eval"][0][1] - 0.5  # it learns


@pytest.mark.slow
@pytest.mark.parametrize("task", conv.TASKS)
def test_with_dropout_same_start_different_masks_both_learn(task):
    ref = conv.train_losses(task, None, 0, STEPS, **TINY)
    lean = conv.train_losses(task, leanact.patch, 0, STEPS, **TINY)
    assert lean["eval"][0] == ref["eval"][0]
    assert lean["train"][0] != ref["train"][0]  # leanact's dropout draws its own masks
    for r in (ref, lean):
        assert r["final_eval"] < r["eval"][0][1] - 0.5
        assert sum(r["train"][-5:]) < sum(r["train"][:5])
    assert abs(lean["final_eval"] - ref["final_eval"]) < 0.1


@pytest.mark.slow
def test_compare_prints_the_table_and_saves_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from rich.console import Console

    console = Console(record=True, width=200)
    out = tmp_path / "curves.png"
    res = conv.compare({"unpatched": None, "patched": leanact.patch}, ["clm"], [0, 1], 6, out,
                       console=console, **TINY)
    assert out.stat().st_size > 10_000
    text = console.export_text()
    assert "Δ vs unpatched" in text and "RMS noise" in text
    rows = {r["variant"]: r for r in res["summary"]}
    finals = res["results"]["clm"]["unpatched"]
    assert rows["unpatched"]["noise"] == pytest.approx(abs(finals[0]["final_eval"] - finals[1]["final_eval"]))
    assert rows["patched"]["max_abs_diff"] == pytest.approx(max(
        abs(res["results"]["clm"]["patched"][s]["final_eval"] - finals[s]["final_eval"]) for s in (0, 1)))
    assert rows["unpatched"]["noise_rms"] > 0 and rows["patched"]["rms"] > 0
