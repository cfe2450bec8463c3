"""What the CUDA runtime keeps allocated through the caching allocator across training steps, for
``leanact.estimate(device="cuda")``: memory no tensor of the traced step stands for, yet counted by
``torch.cuda.max_memory_allocated`` in every step after the first.

* **cuBLAS workspaces.** torch gives every (cuBLAS handle, stream) pair a workspace from the
  caching allocator on its first matmul and keeps it for the life of the process. Handles are per
  thread: the forward (and the optimizer step) run on the caller's thread, backward on autograd's
  worker thread for the device, so a training step holds **two** workspaces, each of
  :func:`cublas_workspace_bytes` (``CUBLAS_WORKSPACE_CONFIG``; default 32 MiB on Hopper and newer,
  ``:4096:2:16:8`` = 8.125 MiB before). A thread holds one only if it runs a matmul
  (``mm``, ``addmm``, ``bmm``, ...): :class:`BlasUse` records which threads do in the trace
  (backward = inside an autograd graph task).
* **cuBLASLt workspaces.** ``addmm`` with a 1-D bias (``nn.Linear`` with bias, on 2-D inputs or
  flattened ones) runs cuBLASLt's bias epilogue, whose workspace torch keeps per (handle, stream)
  too: ``CUBLASLT_WORKSPACE_SIZE`` (default 1 MiB) in a separate allocation up to torch 2.11;
  torch 2.12+ shares the cuBLAS workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default),
  nothing more.
* **leanact's device tables.** leanact's GELU looks up its 16-bit forward and backward in tables
  built once per device and dtype (:mod:`leanact.ops.gelu.tables`): the trace reads the CPU copies
  (built beforehand, not part of the step); on a GPU they sit in device memory from the first step on.
  The GELU's fake-tensor rule reports the tables it read (:attr:`leanact.ops.fake_rules.FakeRun.held`).

The GPU modelled (:func:`target`): the current CUDA device where torch sees one, else a Hopper GPU
(compute capability 9.0, 132 SMs: H100 SXM / H200), the GPUs the 80 GiB budgets are about.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GPU", "target", "cublas_workspace_bytes", "cublaslt_workspace_bytes", "BlasUse",
           "runtime_bytes"]

MIB = 1 << 20


@dataclass(frozen=True)
class GPU:
    """The GPU a CUDA estimate stands for."""

    capability: tuple[int, int] = (9, 0)
    sms: int = 132


def target() -> GPU:
    """The current CUDA device if torch sees one, else a Hopper GPU (module doc)."""
    try:
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            return GPU((p.major, p.minor), p.multi_processor_count)
    except (RuntimeError, AssertionError):  # pragma: no cover - a broken CUDA setup: the default
        pass
    return GPU()


def _workspace_config(value: str) -> int | None:
    """torch's parse of ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE:COUNT" pairs, KiB): the sum of SIZE·COUNT."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", value)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else None


def cublas_workspace_bytes(gpu: GPU | None = None) -> int:
    """The cuBLAS workspace per (handle, stream): ``CUBLAS_WORKSPACE_CONFIG`` if set (and parsable),
    else torch's default for the GPU: 32 MiB from compute capability 9 (Hopper) on, else
    ``:4096:2:16:8`` (2 · 4 MiB + 8 · 16 KiB)."""
    gpu = gpu or target()
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    parsed = _workspace_config(value) if value else None
    if parsed is not None:
        return parsed
    return 32 * MIB if gpu.capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def _torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def cublaslt_workspace_bytes(gpu: GPU | None = None) -> int:
    """The extra cuBLASLt workspace per (handle, stream) that runs a cuBLASLt matmul: 0 where torch
    shares the cuBLAS one (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``: on by default from torch 2.12),
    else ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), at most the cuBLAS workspace."""
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is not None:
        shared = unified.strip().lower() in ("1", "true", "on", "yes")
    else:
        shared = _torch_version() >= (2, 12)
    if shared:
        return 0
    try:
        kib = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024"))
    except ValueError:
        kib = 1024
    return min(kib * 1024, cublas_workspace_bytes(gpu))


_ops = torch.ops.aten
_BLAS = frozenset(getattr(_ops, n) for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                                             "addr", "_addmm_activation", "_int_mm") if hasattr(_ops, n))
_LT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class BlasUse(TorchDispatchMode):
    """Records which threads of a CUDA step run cuBLAS (``threads``: "forward" for the caller's
    thread, "backward" for autograd's worker) and which run cuBLASLt's bias epilogue (``lt``).
    Enter it above the fake mode (the ops reach it before the fake tensors are made)."""

    def __init__(self):
        super().__init__()
        self.threads: set[str] = set()
        self.lt: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", None)
        if packet in _BLAS:
            where = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.threads.add(where)
            if packet in (_ops.addmm, _ops._addmm_activation) and _bias_epilogue(args, kwargs or {}):
                self.lt.add(where)
        return func(*args, **(kwargs or {}))


def _bias_epilogue(args, kwargs) -> bool:
    """``addmm(bias, a, b)`` as torch's CUDA ``addmm`` sends to cuBLASLt: a 1-D bias, 2-D matrices with
    more than one row and column, beta 1 (``DISABLE_ADDMM_CUDA_LT=1`` turns it off)."""
    if os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1" or len(args) < 3:
        return False
    bias, a, b = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return (isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.dtype in _LT_DTYPES and a.dim() == 2
            and b.dim() == 2 and a.shape[0] > 1 and a.shape[1] > 1 and b.shape[1] > 1 and beta == 1)


@dataclass
class Runtime:
    """Bytes the CUDA runtime holds across steps (module doc), by item."""

    items: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())


def runtime_bytes(blas: BlasUse, held: dict, block: int = 512, gpu: GPU | None = None) -> Runtime:
    """What :class:`BlasUse` saw and what leanact's ops hold on the device across steps (``held``:
    :attr:`leanact.ops.fake_rules.FakeRun.held`), in bytes (each allocation rounded up to ``block``,
    as the caching allocator does)."""
    gpu = gpu or target()

    def rounded(n: int) -> int:
        return -(-n // block) * block if n else 0

    items: dict[str, int] = {}
    ws, lt = cublas_workspace_bytes(gpu), cublaslt_workspace_bytes(gpu)
    for where in sorted(blas.threads):
        items[f"cuBLAS workspace ({where} thread)"] = rounded(ws)
    for where in sorted(blas.lt):
        if lt:
            items[f"cuBLASLt workspace ({where} thread)"] = rounded(lt)
    for what, n in sorted(held.items()):
        items[what] = rounded(n)
    return Runtime(items)
