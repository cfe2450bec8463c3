"""One command for a CUDA machine: tests, kernel timings, memory and speed, appended to RESULTS.md.

    python benchmarks/gpu_suite [--out benchmarks/RESULTS.md]
        [--parts tests ops bert llama estimate offload head steps long profile compiled]

Parts (each in its own process with its own time limit, so a crash, a hang or a poisoned CUDA
context in one part leaves the others running; every part says whether it ran, failed or timed
out, and what it finished before that). A configuration that runs out of GPU memory is a result,
not a crash: its row says "OOM" (with a note), memory is freed (``gc.collect``,
``torch.cuda.empty_cache``) and the part goes on with the next one:

1. ``tests``: the CUDA subset of the test suite (``-m "cuda or triton"``: the compiled Triton
   kernels against the PyTorch path on CUDA, patched tiny models against unpatched ones, attention,
   offload, the dropout mask across devices). Failed if any test failed or errored (the counts and
   the failing tests are kept).
2. ``ops``: forward+backward time of each lean op (Triton kernels, and the PyTorch path with
   ``LEANACT_TRITON=0``) against torch's own op of the same role, and Liger-Kernel's RMSNorm /
   LayerNorm / SwiGLU when ``liger_kernel`` imports: wall time per call, and the kernels' own device
   time and launches per call (torch.profiler); with leanact's achieved bandwidth (the bytes its
   kernels must move, :func:`moved_bytes`, over its kernels' device time) and that as a share of the
   device's peak (a note gives the peak: from the device's memory clock and bus width where torch
   reports them, else its datasheet value, and a measured device-to-device copy). Target: leanact
   ≤ 1.1x torch.
3. ``bert``: Tempo's comparison. BERT-Large (s=512, bf16 autocast, AdamW) under a memory cap
   (``torch.cuda.set_per_process_memory_fraction``), each mode at its own largest batch (an OOM in
   the search is a "no"; one outside it is the mode's row) and its throughput there: HF sdpa and
   leanact (its Triton kernels on) under 8 GiB (Tempo's 11 GB card, where the baseline fits about 2
   sequences) and 16 GiB, then HF eager and HF sdpa + gradient checkpointing under 16 GiB
   (:data:`BERT_CAPS`). Targets, leanact vs HF sdpa: at 8 GiB batch ≥ 1.6x and throughput ≥ 1.16x
   (Tempo's +16%); at 16 GiB batch ≥ 1.6x and throughput ≥ 1.0x. (The b=32 step time and peak
   against HF sdpa: the ``steps`` part.)
4. ``llama``: LLaMA-1B-like (Llama-3.2-1B geometry) training-step time at equal batch, HF sdpa vs
   leanact with its Triton kernels and with its PyTorch path. Target ≤ 1.05x.
5. ``estimate``: ``leanact.estimate(device="cuda")`` against ``torch.cuda.max_memory_allocated`` of a
   real steady-state step. Target: within 5%.
6. ``offload``: step time and peak with and without CPU offload of every layer (overlap).
7. ``head``: head + causal-LM loss forward+backward at 8,192 tokens, hidden 2048, V=128,256, bf16
   weights and inputs (issue #23): HF's ``ForCausalLMLoss(F.linear(x, W), labels, V)``, leanact's
   ``linear_cross_entropy(..., grad_in_forward=True)`` (what ``leanact.patch`` runs in training),
   torch's ``F.linear_cross_entropy`` (torch >= 2.13) and Liger-Kernel's
   ``LigerFusedLinearCrossEntropyLoss`` where they exist (a note where not), in turns: median time,
   ratio to HF, transient above the inputs (dx, dW included; also as % of HF's fp32 logits N·V·4),
   max relative difference of loss / dx / dW to HF's. Targets: leanact ≤ HF's and Liger's time,
   transient without dx, dW ≤ 5% of the fp32 logits.
8. ``steps``: whole training steps side by side in one process, in turns (A, B, C, A, ...; fp32
   weights + bf16 autocast, fused AdamW, each mode its own model with the same seed, all kept
   allocated when they fit, else one after another with a note): Llama-3.2-1B geometry b=4 s=2048,
   HF sdpa / Liger-Kernel (its Llama patch, swapped in only for its own model) / leanact, then
   BERT-Large MLM b=32 s=512, HF sdpa / leanact. Targets: Llama leanact ≤ 1.00x HF's step and ≤
   Liger's, peak ≤ 0.55x HF's; BERT-Large ≤ 1.05x, peak ≤ 0.6x.

9. ``long`` (only when named: ``--parts long``; up to 9 minutes, a device call of its own): the
   Llama-3.2-1B geometry in bf16, batch 1, AdamW, with ``full+tiled_mlp`` and with
   ``offload+recompute+tiled_mlp`` on every layer at 8,192, 16,384 and 32,768 tokens (target: offload ≤
   1.10x from the length where its copies fit under compute), each measured peak and host memory
   against ``leanact.estimate(device="cuda")``; then the planner's edge: the longest sequence predicted
   to fit with offload under 16 GiB (:data:`LONG_CAP_SEQ`) and 24 GiB (1B) and 24 GiB (Llama-3.1-8B
   geometry, LoRA r=16) runs under that cap (target: no OOM, peak within 3%), and 10% more is
   predicted over the cap and runs out of memory when forced.
10. ``profile`` (only when named: ``--parts profile``; about a minute): the ``steps`` part's
   BERT-Large and Llama steps, HF sdpa and leanact, one step each under torch.profiler after a
   warm-up step: the step's kernels by device time (:data:`PROFILE_TOP` of them), launches and wall
   time. Where a step-time gap comes from.
11. ``compiled`` (only when named: ``--parts compiled``; up to 4 minutes): the ``steps`` part's
   steps with every model under ``torch.compile`` (inductor): Llama-3.2-1B geometry (HF sdpa, Liger,
   leanact) and BERT-Large (HF sdpa, leanact), each model's first step (tracing and compiling) noted
   (targets: leanact ≤ 0.90x HF sdpa's compiled step and ≤ Liger's, Llama peak ≤ 0.5x, BERT ≤ 0.6x).

The default run (parts 1-8) stays under 9.5 minutes (the per-part limits add up to :data:`TOTAL_S`). Rows go to
``--out`` under a header with the device, torch / triton / transformers / liger-kernel versions, the
git commit of the leanact package that runs ("unknown" outside a git checkout) and the date.
Without CUDA it exits with a message and writes nothing.

``--smoke --out FILE`` runs every part on the CPU at tiny sizes (:data:`SIZES`; no CUDA calls, peaks
"n/a", ``tests`` a small CPU subset) to catch Python errors in the parts before a GPU run.

The package: ``__main__`` (the command line, and the ``--worker`` process of a part), ``common`` (the
parts' limits, sizes, titles and columns; the rows a part records; device, memory and timing helpers;
a part's process; the markdown), a module per part (``tests``, ``ops``, ``bert``, ``llama``,
``estimate``, ``offload``, ``head``, ``steps``, ``long``, ``profile``, ``compiled``), and what parts share: ``models``
(the models and their training steps), ``side_by_side`` (modes timed in turns), ``liger``
(Liger-Kernel's ops and patches).
"""
