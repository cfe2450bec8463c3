"""Whether this CPU multiplies 16-bit matrices natively.

oneDNN has bf16 GEMM kernels for AVX512-BF16 and AMX, fp16 ones for AMX-FP16; elsewhere torch runs a
16-bit matmul on the CPU in a slower path, tens of times fp32's time on an AVX2-only CPU
(docs/benchmarks.md, "Measurements behind the library's constants"). The fused head then
multiplies in fp32, and ``leanact profile`` defaults to fp32.
"""
from __future__ import annotations

import torch

__all__ = ["native_16bit_gemm"]


def native_16bit_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has native GEMM kernels for ``dtype`` (bfloat16 or float16)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.cpu._is_amx_fp16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - other torch builds
        return True
