"""``leanact.estimate_trainer``: one step of TRL's trainers (policy and reference) predicted on fake
tensors, against the same step measured on real tensors (``measure_trainer``), for SFT, DPO, KTO,
GRPO and RLOO, unpatched and with ``leanact.patch``; the trainer is left as it was."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from test_trl import TRAINERS, base_model, dataset, reward_length, tokenizer  # noqa: E402

import leanact  # noqa: E402
from leanact.estimate import estimate_trainer, measure_trainer  # noqa: E402
from leanact.estimate.trainer import first_batch  # noqa: E402

pytestmark = pytest.mark.slow


def make(name, patched, tied=False, **options):
    trainer_cls, config_cls, kind, takes_ref = TRAINERS[name]
    model, ref = base_model(tied), base_model(tied) if takes_ref else None
    if patched:
        model = leanact.patch(model)
        ref = leanact.patch(ref) if ref is not None else None
    config = dict(output_dir="out", per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                  save_strategy="no", bf16=False, seed=0, **options)
    extra = dict(ref_model=ref) if takes_ref else {}
    if name in ("grpo", "rloo"):
        config.update(num_generations=2, max_completion_length=6, beta=0.0)
        extra["reward_funcs"] = reward_length
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(trl, trainer_cls)(model=model, args=getattr(trl, config_cls)(**config),
                                         train_dataset=dataset(kind), processing_class=tokenizer(), **extra)


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_estimate_equals_the_measured_step(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = {}
    for patched in (False, True):
        trainer = make(name, patched)
        held = {k: v for k, v in vars(trainer).items() if isinstance(v, torch.nn.Module)}
        weights = {k: [p.detach().clone() for p in m.parameters()] for k, m in held.items()}
        torch.manual_seed(0)
        batch = first_batch(trainer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = estimate_trainer(trainer, batch)
            got = measure_trainer(trainer, batch)
        assert est.saved == got.saved  # what autograd keeps: to the byte
        assert abs(est.peak - got.peak) <= 0.03 * got.peak, (est.peak, got.peak)  # (measured: equal to the byte)
        assert est.params == got.params and est.grads == got.grads
        # the trainer holds its own models again, unchanged
        assert {k: v for k, v in vars(trainer).items() if isinstance(v, torch.nn.Module)} == held
        assert trainer.model_wrapped is trainer.model
        for k, m in held.items():
            assert all(torch.equal(a, b) for a, b in zip(weights[k], m.parameters()))
        saved[patched] = est.saved
    assert saved[True] < saved[False]


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_tied_embedding_estimated_as_measured(name, tmp_path, monkeypatch):
    """Tied embeddings: the estimate traces the hand-off and the late weight gradient (TRL's
    checkpointing) as the real step runs them, the ids real (the trainer's integer inputs)."""
    from leanact.ops.embedding import handed_off

    monkeypatch.chdir(tmp_path)
    trainer = make(name, True, tied=True)
    torch.manual_seed(0)
    batch = first_batch(trainer)
    before = handed_off()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_trainer(trainer, batch)
        assert handed_off() - before == 1
        got = measure_trainer(trainer, batch)
    assert handed_off() - before >= 2
    assert est.saved == got.saved
    assert abs(est.peak - got.peak) <= 0.03 * got.peak, (est.peak, got.peak)


def test_reference_model_is_counted(tmp_path, monkeypatch):
    """DPO with a reference: its weights are parameters of the step; its forward runs (no gradients)."""
    monkeypatch.chdir(tmp_path)
    trainer = make("dpo", True)
    batch = first_batch(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_trainer(trainer, batch)
    own = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    ref = sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters())
    assert est.params == own + ref
    assert est.grads == own


def test_models_restored_after_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = make("dpo", False)
    batch = first_batch(trainer)
    model, ref = trainer.model, trainer.ref_model

    def fails(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "compute_loss", fails)
    with pytest.raises(KeyboardInterrupt):
        estimate_trainer(trainer, batch)
    assert trainer.model is model and trainer.ref_model is ref and trainer.model_wrapped is model
    assert "current_gradient_accumulation_steps" not in vars(trainer)


def test_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="takes a transformers.Trainer"):
        estimate_trainer(base_model())
    trainer = make("sft", False)
    trainer.model_wrapped = torch.nn.Sequential(trainer.model)
    with pytest.raises(ValueError, match="wrapped"):
        estimate_trainer(trainer)


def test_cuda_prediction_with_trl_head(tmp_path, monkeypatch):
    """For a GPU, TRL's head is traced with its per-tile torch folds allocation-free (its Triton kernels'
    case): the prediction runs, keeps what the CPU trace keeps, says so in its notes, and TRL's
    module gets its own folds back."""
    monkeypatch.chdir(tmp_path)
    trainer = make("dpo", True)
    batch = first_batch(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cuda = estimate_trainer(trainer, batch, device="cuda")
        cpu = estimate_trainer(trainer, batch)
    assert cuda.device == "cuda" and any("Triton" in n for n in cuda.notes)
    assert cuda.saved == cpu.saved
    from trl.kernels import chunked_logprob

    assert chunked_logprob._forward_tile.__name__ == "_forward_tile"  # restored


def test_checkpointing_where_train_turns_it_on(tmp_path, monkeypatch):
    """TRL's configs turn gradient checkpointing on, and ``trainer.train()`` applies it: the estimate
    does as train() does, on its copy (the trainer's model is not changed)."""
    monkeypatch.chdir(tmp_path)
    kept = {}
    for on in (True, False):
        trainer = make("dpo", False, gradient_checkpointing=on)
        before = trainer.model.is_gradient_checkpointing
        batch = first_batch(trainer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kept[on] = estimate_trainer(trainer, batch).saved
            assert measure_trainer(trainer, batch).saved == kept[on]
        assert trainer.model.is_gradient_checkpointing == before
    assert kept[True] < kept[False] / 2


def test_the_trainers_own_optimizer(tmp_path, monkeypatch):
    """The step's optimizer is the trainer's: from ``args.optim`` before training (``adamw_torch_fused``
    by default: a fused AdamW), the one it holds after (Accelerate's wrapper unwrapped); ``optimizer=``
    still takes another."""
    from leanact.estimate.trainer import trainer_optimizer

    monkeypatch.chdir(tmp_path)
    trainer = make("sft", True)
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = trainer_optimizer(trainer)(p)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and opt.defaults["lr"] == trainer.args.learning_rate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW  # (in Accelerate's wrapper)
    again = trainer_optimizer(trainer)(p)
    assert type(again) is torch.optim.AdamW and again.defaults["fused"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = estimate_trainer(trainer, first_batch(trainer))
        foreach = estimate_trainer(trainer, first_batch(trainer), optimizer="adamw")
    assert fused.optimizer_state == foreach.optimizer_state and fused.peak <= foreach.peak
