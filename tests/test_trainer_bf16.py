"""``transformers.Trainer(bf16=True, use_cpu=True)`` (fp32 weights, bf16 autocast) on a patched model:
it trains, its losses follow the unpatched run's autocast numerics (error against an fp32 run at
most 2x the unpatched one's, with one bf16 rounding as the floor), and the meter, entered around
Trainer's own ``training_step``, shows the savings there (autocast's casts rebuilt, not kept)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.patching import patch  # noqa: E402
from leanact.recompute import counters, reset_counters  # noqa: E402

import test_trainer as tt  # noqa: E402

STEPS = 3


class _MeteredTrainer(transformers.Trainer):
    """Records what autograd keeps during each of Trainer's own training steps."""

    kept: list

    def training_step(self, model, *args, **kwargs):
        meter = SavedTensorMeter(model)
        with meter:
            loss = super().training_step(model, *args, **kwargs)
        self.kept.append((meter.total_bytes, {r.dtype for r in meter.counted()}))
        return loss


def _train(model, family, out_dir, bf16):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), report_to=[], max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", use_cpu=True, bf16=bf16, seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = _MeteredTrainer(model=model, args=args, train_dataset=tt._Data(causal=family != "bert"))
    trainer.kept = []
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return losses, trainer.kept


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_trainer_bf16_patched(family, tmp_path):
    ref = tt._model(family)
    lean = patch(copy.deepcopy(ref))
    l32, _ = _train(copy.deepcopy(ref), family, tmp_path / "fp32", bf16=False)
    l_ref, kept_ref = _train(ref, family, tmp_path / "ref", bf16=True)
    reset_counters()
    l_lean, kept_lean = _train(lean, family, tmp_path / "lean", bf16=True)
    assert l_ref[0] != l_ref[-1]  # it trained
    err = lambda ls: max(abs(a - b) / abs(b) for a, b in zip(ls, l32))  # noqa: E731
    assert err(l_lean) <= 2 * max(err(l_ref), 2.0 ** -9), (l32, l_ref, l_lean)
    # the step ran under bf16 autocast with fp32 weights, and the casts of the fp32 norm outputs
    # were rebuilt in backward instead of kept
    assert all(torch.bfloat16 in dtypes and torch.float32 in dtypes for _, dtypes in kept_lean)
    assert counters().get("recompute:cast", 0) > 0
    assert all(b < 0.75 * a for (a, _), (b, _) in zip(kept_ref, kept_lean)), (kept_ref, kept_lean)
