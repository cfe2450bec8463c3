"""A patched model trains unchanged under Hugging Face's ``Trainer`` (CPU, fp32, dropout 0, 5 steps,
tiny BERT MLM and tiny Llama CLM on an in-memory dataset): the logged training losses equal the
unpatched model's run with the same seed (1e-5 relative), and the trained patched model saves
and loads into a fresh, unpatched model."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's dependency

from leanact.patching import patch  # noqa: E402

import test_patch_families as fam  # noqa: E402
import test_patch_llama as llama  # noqa: E402

STEPS = 5


class _Data(torch.utils.data.Dataset):
    """Random token sequences; MLM: 30% of positions labelled, CLM: labels = inputs."""

    def __init__(self, causal: bool, n: int = 16, s: int = 12):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(3, 100, (n, s), generator=g)
        self.mask = torch.ones(n, s, dtype=torch.long)
        self.mask[::3, s // 2:] = 0  # some padded rows
        pick = torch.rand(n, s, generator=g) < 0.3
        pick[:, 0] = True
        labels = self.ids if causal else torch.where(pick, self.ids, torch.full_like(self.ids, -100))
        self.labels = labels.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return dict(input_ids=self.ids[i], attention_mask=self.mask[i], labels=self.labels[i])


def _model(family):
    return fam._build("bert") if family == "bert" else llama._build("llama")


def _train(model, family, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), report_to=[], max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(causal=family != "bert"))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return trainer, losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_trainer_losses_match_unpatched(family, tmp_path):
    ref = _model(family)
    lean = patch(copy.deepcopy(ref))
    _, l_ref = _train(ref, family, tmp_path / "ref")
    trainer, l_lean = _train(lean, family, tmp_path / "lean")
    assert l_ref[0] != l_ref[-1]  # the model did train
    for a, b in zip(l_ref, l_lean):
        assert abs(a - b) <= 1e-5 * abs(a), (l_ref, l_lean)
    assert lean.config._attn_implementation == "leanact"  # the Trainer left the patch in place

    trainer.save_model(str(tmp_path / "final"))
    loaded = type(ref).from_pretrained(str(tmp_path / "final"))
    assert not hasattr(loaded, "_leanact_patch")
    sd_lean, sd_loaded = lean.state_dict(), loaded.state_dict()
    assert list(sd_loaded) == list(sd_lean)
    assert all(torch.equal(sd_loaded[k], sd_lean[k]) for k in sd_lean)
    batch = _Data(causal=family != "bert")[0]
    batch = {k: v[None] for k, v in batch.items()}
    lean.eval(), loaded.eval()
    loaded.set_attn_implementation("sdpa")  # as the model before patching (the patched one runs it in no_grad)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, lean(**batch).logits)
