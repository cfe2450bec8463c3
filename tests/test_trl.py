"""TRL's post-training trainers on leanact-patched models: SFT, DPO, KTO, GRPO and RLOO.

Each case runs one optimizer step of the trainer twice from the same state and the same seed: once
with an unpatched tiny Llama (and reference model), once with ``leanact.patch`` applied to the policy
and to the reference. The loss TRL reports and every gradient the optimizer receives (read at
``on_pre_optimizer_step``, after gradient accumulation) agree in fp32: gradients within 1e-5 of their
norm, losses within 1e-5 (absolute where a loss is 0 in exact arithmetic: GRPO and RLOO at the first
step of an unchanged policy). TRL puts its own fused LM head on the policy (and the reference):
leanact's backbone runs under it (see docs/post_training.md).
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from _tol import assert_grads_close  # noqa: E402

import leanact  # noqa: E402

pytestmark = pytest.mark.slow  # (Trainer set-up and dataset preparation: seconds per run)

V = 100


def tokenizer():
    """A word-level tokenizer over ``t0`` … ``t99`` (pad t0, eos t1, bos t2), made here: no hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1", bos_token="t2")


def base_model(tied=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=2, attn_implementation="sdpa",
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norm weights (HF initialises them to 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def words(g, n):
    return " ".join(f"t{i}" for i in torch.randint(3, V, (n,), generator=g).tolist())


def dataset(kind):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    lengths = (5, 7, 4, 6)
    if kind == "sft":
        return Dataset.from_dict({"input_ids": [torch.randint(3, V, (n + 6,), generator=g).tolist()
                                                for n in lengths]})
    prompts = [words(g, n) for n in lengths]
    if kind == "preference":  # (a completion starts with a space: token boundaries as in the prompt alone)
        return Dataset.from_dict({"prompt": prompts, "chosen": [" " + words(g, 4) for _ in lengths],
                                  "rejected": [" " + words(g, 6) for _ in lengths]})
    if kind == "unpaired":
        return Dataset.from_dict({"prompt": prompts, "completion": [" " + words(g, 3 + i) for i in range(4)],
                                  "label": [True, False, True, False]})
    return Dataset.from_dict({"prompt": prompts})


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


class _Grads(transformers.TrainerCallback):
    """The gradients the optimizer is about to apply (after accumulation), by parameter name."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


TRAINERS = {  # name -> (trainer, config, dataset kind, takes a reference model)
    "sft": ("SFTTrainer", "SFTConfig", "sft", False),
    "dpo": ("DPOTrainer", "DPOConfig", "preference", True),
    "kto": ("KTOTrainer", "KTOConfig", "unpaired", True),
    "grpo": ("GRPOTrainer", "GRPOConfig", "prompts", False),
    "rloo": ("RLOOTrainer", "RLOOConfig", "prompts", False),
}


def run(name, patched, *, lora=False, tied=False, **options):
    """(loss TRL logs, gradients) of one step of trainer ``name``; ``patched``: leanact.patch on the
    policy and the reference. Ranking trainers generate with the policy (sampling, seeded)."""
    trainer_cls, config_cls, kind, takes_ref = TRAINERS[name]
    model, ref = base_model(tied), base_model(tied) if takes_ref else None
    if options.get("beta") and name in ("grpo", "rloo"):  # TRL loads the reference from the policy's path
        base_model().save_pretrained("reference")
        model.config._name_or_path = "reference"
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           lora_dropout=0.0))
        ref = None
    if patched:
        model = leanact.patch(model)
        ref = leanact.patch(ref) if ref is not None else None
    config = dict(output_dir="out", per_device_train_batch_size=4, max_steps=1, learning_rate=0.0, report_to=[],
                  use_cpu=True, save_strategy="no", bf16=False, logging_steps=1, seed=0)
    if name in ("grpo", "rloo"):
        config.update(num_generations=2, max_completion_length=6, beta=0.0)
    config.update(options)
    assert not options.get("beta") or name in ("grpo", "rloo")
    extra = dict(ref_model=ref) if takes_ref else {}
    if name in ("grpo", "rloo"):
        extra["reward_funcs"] = reward_length
    grads = _Grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = getattr(trl, trainer_cls)(model=model, args=getattr(trl, config_cls)(**config),
                                            train_dataset=dataset(kind), processing_class=tokenizer(),
                                            callbacks=[grads], **extra)
        torch.manual_seed(0)
        out = trainer.train()
    assert grads.grads, "no gradient reached the optimizer"
    return out.training_loss, grads.grads


def check(name, **options):
    want_loss, want = run(name, False, **options)
    got_loss, got = run(name, True, **options)
    assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (got_loss, want_loss)
    assert_grads_close(want, got)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_trainer_step_matches_unpatched(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check(name)


def test_sft_padding_free_and_gradient_accumulation(tmp_path, monkeypatch):
    """Padding-free batches (TRL's packing into one row, position_ids restarting) and two accumulated
    micro-batches."""
    monkeypatch.chdir(tmp_path)
    check("sft", padding_free=True, max_length=None, per_device_train_batch_size=2, gradient_accumulation_steps=2)


@pytest.mark.parametrize("name,options", [("sft", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)),
                                          ("dpo", {}), ("grpo", {}),
                                          ("dpo", dict(gradient_checkpointing=False))])
def test_tied_embeddings(name, options, tmp_path, monkeypatch):
    """Tied input and output embeddings (Llama 3.2 1B's): the lean head hands its weight gradient to the
    embedding (computed there, late, under TRL's default checkpointing), with accumulated micro-batches
    too: the trainers' losses and gradients are the unpatched run's."""
    from leanact.ops.embedding import handed_off

    monkeypatch.chdir(tmp_path)
    before = handed_off()
    check(name, tied=True, **options)
    assert handed_off() > before


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_ranking_with_a_reference_model(name, tmp_path, monkeypatch):
    """beta > 0: a KL term against a reference model TRL builds from the policy's path (it takes the
    policy's attention implementation: "leanact" for a patched policy)."""
    monkeypatch.chdir(tmp_path)
    check(name, beta=0.1)


def test_dpo_with_lora(tmp_path, monkeypatch):
    """PEFT LoRA on every linear layer; the reference is the policy with its adapters off (TRL's way)."""
    monkeypatch.chdir(tmp_path)
    check("dpo", lora=True)


def test_policy_under_trl_keeps_trl_head_and_lean_backbone():
    """Under TRL the fused head is TRL's (``add_fused_lm_head``, as every trainer above installs it: the
    forward returns per-token log-probabilities, no logits); the backbone under it is leanact's and
    keeps less for backward than the unpatched backbone under the same head."""
    from trl.trainer.utils import add_fused_lm_head

    from leanact.memory import SavedTensorMeter

    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    kept = {}
    for patched in (False, True):
        model = base_model().train()
        if patched:
            model = leanact.patch(model)
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        with SavedTensorMeter(model) as meter:
            out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        assert type(out).__name__ == "FusedCausalLMOutput" and out.log_probs.shape == (2, 8)
        kept[patched] = meter.activation_bytes
        out.loss.backward()
    assert 0 < kept[True] < kept[False], kept
