"""One TRL post-training step (DPO, GRPO) on the Llama-3.2-1B geometry: TRL alone against leanact + TRL.

    python benchmarks/trl_step.py [--layers 2] [--tokens 1024] [--trainers dpo grpo] [--dtype fp32]
                                  [--no-checkpointing] [--markdown] [--predict cpu|cuda] [--rss]
                                  [--late-head-grad auto|on|off] [--checkpointing-only]

The model: the Llama-3.2-1B geometry (h=2048, 32/8 heads, SwiGLU 8192, its 128,256-token vocabulary, tied
embeddings) at ``--layers`` layers, ``--dtype`` weights (bf16 by default; fp32 on CPUs without native
bf16 matrix products, where a bf16 step takes hours), random; a word-level tokenizer over the vocabulary.
DPO: 2 preference pairs of ``--tokens`` tokens each (prompt + completion; TRL runs chosen and rejected as one
batch of 4), with the reference model. GRPO: 2 prompts × 2 generations of ``--tokens`` tokens (prompt +
16 generated), beta 0. Each side runs one step on the CPU, TRL's own fused LM head in both; the second
side has ``leanact.patch`` on the policy (and the reference). Both keep TRL's default gradient
checkpointing (every layer recomputed in backward) unless ``--no-checkpointing``. Measured in that step:

* ``peak``: the most bytes of CPU tensor storage made during ``training_step`` and alive at once
  (generation for GRPO, forward and backward: gradients, activations, temporaries; the weights and
  the optimizer's state, made after it, are not in it);
* ``kept``: the bytes autograd keeps at the end of the forward (``SavedTensorMeter``: storages
  counted once, parameters excluded).

``--rss`` runs each side's step (with and without TRL's checkpointing) in a fresh process with no
tracker at all (a tracker is a ``TorchDispatchMode``, under which autograd adds a tied embedding's
gradient out of place) and reports the peak RSS during ``trainer.train()`` above the RSS at its
start (Linux): the whole step, the AdamW state it creates included, with TRL's CPU fallback for its
head's tiles (fp32 temporaries that its Triton kernels on a GPU do not make).
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import leanact  # noqa: E402
from leanact.memory import SavedTensorMeter  # noqa: E402
from leanact.models.geometries import resolve  # noqa: E402

MIB = 2**20


def tokenizer(vocab: int):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1", bos_token="t2")


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LATES = {"auto": None, "on": True, "off": False}
LATE_HEAD_GRAD = [None]  # leanact.patch's late_head_grad (--late-head-grad)


def build(layers: int, patched: bool, dtype: torch.dtype):
    import transformers

    cfg = resolve("llama-1b-like").make_config(attn="sdpa")
    cfg.num_hidden_layers = layers
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return leanact.patch(model, late_head_grad=LATE_HEAD_GRAD[0]) if patched else model


def data(kind: str, tokens: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)

    def words(n):
        return " ".join(f"t{i}" for i in torch.randint(3, vocab, (n,), generator=g).tolist())

    if kind == "dpo":
        prompt = tokens // 2
        return Dataset.from_dict({"prompt": [words(prompt) for _ in range(2)],
                                  "chosen": [" " + words(tokens - prompt) for _ in range(2)],
                                  "rejected": [" " + words(tokens - prompt) for _ in range(2)]})
    return Dataset.from_dict({"prompt": [words(tokens - 16) for _ in range(2)]})


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage made inside the region and alive at once (each storage
    counted once, from its creation until it is freed); weights and what existed before are not
    counted, nor their views. Like every tracker that sees each op's outputs (``MemTracker``), it holds
    them long enough that autograd sums the two gradients of a tied embedding out of place: one
    vocabulary × hidden buffer more, at the embedding's backward, than an untracked run, on both sides."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _forget(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen and key not in inputs:  # (views and in-place ops make nothing)
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._forget, key, storage.nbytes())
        return out


class _Measured:
    """Wraps the trainer's ``training_step`` (MemTracker) and its ``compute_loss`` (SavedTensorMeter)."""

    def __init__(self, trainer):
        self.trainer, self.peak, self.kept = trainer, None, None
        self.step, self.loss = trainer.training_step, trainer.compute_loss
        trainer.training_step, trainer.compute_loss = self.training_step, self.compute_loss

    def training_step(self, model, inputs, *args, **kwargs):
        with _LiveBytes() as live:
            out = self.step(model, inputs, *args, **kwargs)
        self.peak = live.peak
        return out

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.kept is not None:
            return self.loss(model, inputs, *args, **kwargs)
        with SavedTensorMeter(model) as meter:
            out = self.loss(model, inputs, *args, **kwargs)
        self.kept = meter.activation_bytes
        return out


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trainer_for(kind: str, layers: int, tokens: int, patched: bool, dtype: torch.dtype, checkpointing: bool):
    """TRL's DPO (with the reference model) or GRPO trainer on the model :func:`build` makes."""
    import trl

    model = build(layers, patched, dtype)
    vocab = model.config.vocab_size
    common = dict(output_dir="trl_step_out", per_device_train_batch_size=2, max_steps=1, learning_rate=1e-6,
                  report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1, seed=0,
                  gradient_checkpointing=checkpointing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "dpo":
            ref = build(layers, patched, dtype)
            return trl.DPOTrainer(model=model, ref_model=ref, args=trl.DPOConfig(max_length=None, **common),
                                  train_dataset=data(kind, tokens, vocab), processing_class=tokenizer(vocab))
        common["per_device_train_batch_size"] = 4
        return trl.GRPOTrainer(model=model, reward_funcs=reward_length,
                               args=trl.GRPOConfig(num_generations=2, max_completion_length=16, beta=0.0, **common),
                               train_dataset=data(kind, tokens, vocab), processing_class=tokenizer(vocab))


def run(kind: str, layers: int, tokens: int, patched: bool, dtype: torch.dtype,
        checkpointing: bool = True) -> tuple[int, int, float]:
    trainer = trainer_for(kind, layers, tokens, patched, dtype, checkpointing)
    measured = _Measured(trainer)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return measured.peak, measured.kept, time.perf_counter() - t0


def predict(kind: str, layers: int, tokens: int, patched: bool, dtype: torch.dtype, device: str,
            checkpointing: bool = True) -> tuple[int, int, int]:
    """``leanact.estimate_trainer`` of one step (fake tensors: no matmul runs; the models are built in
    fp32, the estimate casts them to ``dtype``): (whole step's peak, that peak less the weights and
    the optimizer's state, bytes kept for backward)."""
    from leanact.estimate import estimate_trainer
    from leanact.estimate.trainer import first_batch

    trainer = trainer_for(kind, layers, tokens, patched, torch.float32, checkpointing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        est = estimate_trainer(trainer, first_batch(trainer), device=device, dtype=dtype)
    return est.peak, est.peak - est.params - est.buffers - est.optimizer_state, est.saved


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def rss_child(kind: str, layers: int, tokens: int, patched: bool, dtype: torch.dtype, checkpointing: bool) -> None:
    """One ``trainer.train()`` step in this (fresh) process, without any tracker: prints the peak RSS
    above the RSS at its start (Linux: /proc/self/status VmHWM, reset by /proc/self/clear_refs) and
    the seconds it took."""
    trainer = trainer_for(kind, layers, tokens, patched, dtype, checkpointing)
    start = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS restarts from now
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    print("RSS", _status("VmHWM:") - start, time.perf_counter() - t0)


def rss(kind: str, layers: int, tokens: int, patched: bool, dtype: str, checkpointing: bool) -> tuple[int, float]:
    """(peak RSS above the step's start, seconds) of :func:`rss_child` in a fresh process whose allocator
    returns every block over 64 KiB to the system when freed (``MALLOC_MMAP_THRESHOLD_``)."""
    import os
    import subprocess

    late = next(k for k, v in LATES.items() if v is LATE_HEAD_GRAD[0])
    cmd = [sys.executable, __file__, "--rss-child", kind, str(int(patched)), str(int(checkpointing)),
           "--layers", str(layers), "--tokens", str(tokens), "--dtype", dtype, "--late-head-grad", late]
    out = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"), capture_output=True, text=True,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RSS "))
    return int(line.split()[1]), float(line.split()[2])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--trainers", nargs="+", default=["dpo", "grpo"], choices=["dpo", "grpo"])
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--no-checkpointing", action="store_true", help="turn TRL's default gradient checkpointing off")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--predict", choices=["cpu", "cuda"],
                    help="predict the step with leanact.estimate_trainer for this device instead of running it")
    ap.add_argument("--rss", action="store_true",
                    help="run each step in a fresh process without any tracker and report its peak RSS above the "
                         "step's start (Linux), with and without TRL's checkpointing")
    ap.add_argument("--late-head-grad", choices=list(LATES), default="auto",
                    help="leanact.patch(late_head_grad=...): auto (under checkpointing), on, off")
    ap.add_argument("--checkpointing-only", action="store_true", help="--rss: only the rows with TRL's checkpointing")
    ap.add_argument("--rss-child", nargs=3, metavar=("KIND", "PATCHED", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    LATE_HEAD_GRAD[0] = LATES[args.late_head_grad]
    if args.rss_child:
        kind, patched, ckpt = args.rss_child
        rss_child(kind, args.layers, args.tokens, patched == "1", DTYPES[args.dtype], ckpt == "1")
        return
    if args.rss:
        print(f"| step, peak RSS above its start ({args.layers} layers, {args.tokens} tokens per sequence, "
              f"{args.dtype}, CPU) | TRL | leanact + TRL | TRL s | leanact + TRL s |")
        print("|---|---:|---:|---:|---:|")
        for kind in args.trainers:
            for ckpt in (True,) if args.checkpointing_only else (True, False):
                (a, ta), (b, tb) = (rss(kind, args.layers, args.tokens, patched, args.dtype, ckpt)
                                    for patched in (False, True))
                label = f"{kind.upper()}, {'TRL' if ckpt else 'no'} checkpointing"
                print(f"| {label} | {a / MIB:.0f} MiB | {b / MIB:.0f} MiB ({b / a:.2f}x) | {ta:.0f} | {tb:.0f} |",
                      flush=True)
        return
    if args.predict:
        print(f"| predicted step ({args.layers} layers, {args.tokens} tokens per sequence, {args.dtype}, "
              f"{args.predict}) | TRL: peak MiB | above weights and AdamW state | kept | leanact + TRL: peak | "
              "above weights and AdamW state | kept |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind in args.trainers:
            a, b = (predict(kind, args.layers, args.tokens, patched, DTYPES[args.dtype], args.predict,
                            not args.no_checkpointing) for patched in (False, True))
            print(f"| {kind.upper()} | {a[0] / MIB:.0f} | {a[1] / MIB:.0f} | {a[2] / MIB:.0f} | {b[0] / MIB:.0f} | "
                  f"{b[1] / MIB:.0f} ({b[1] / a[1]:.2f}x) | {b[2] / MIB:.0f} ({b[2] / a[2]:.2f}x) |", flush=True)
        return
    rows = []
    for kind in args.trainers:
        trl_alone = run(kind, args.layers, args.tokens, False, DTYPES[args.dtype], not args.no_checkpointing)
        lean = run(kind, args.layers, args.tokens, True, DTYPES[args.dtype], not args.no_checkpointing)
        print(f"{kind}: TRL peak {trl_alone[0] / MIB:.0f} MiB, kept {trl_alone[1] / MIB:.0f} MiB "
              f"({trl_alone[2]:.0f} s); leanact + TRL peak {lean[0] / MIB:.0f} MiB, kept {lean[1] / MIB:.0f} MiB "
              f"({lean[2]:.0f} s)", flush=True)
        rows.append((kind, trl_alone, lean))
    if args.markdown:
        ckpt = "no checkpointing" if args.no_checkpointing else "TRL's checkpointing"
        print(f"\n| step ({args.layers} layers, {args.tokens} tokens per sequence, {args.dtype}, {ckpt}) | "
              "TRL peak MiB | leanact + TRL | ratio | TRL kept MiB | leanact + TRL | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind, a, b in rows:
            print(f"| {kind.upper()} | {a[0] / MIB:.0f} | {b[0] / MIB:.0f} | {b[0] / a[0]:.2f}x | {a[1] / MIB:.0f} | "
                  f"{b[1] / MIB:.0f} | {b[1] / a[1]:.2f}x |")


if __name__ == "__main__":
    main()
