"""Rotary position embedding of q and k, one kernel launch for both each way, bitwise Hugging Face's;
keeps the tables cos and sin for backward, nothing of q or k.

- :mod:`.function`: the autograd Function, :func:`rotary`, the PyTorch references and the
  registration of the kernel's self-check;
- :mod:`.launchers` and :mod:`.kernels`: the Triton path on CUDA.
"""
from .function import RotaryFunction, rotary, rotary_backward_reference, rotary_reference, rotate_half

__all__ = ["RotaryFunction", "rotary", "rotate_half", "rotary_reference", "rotary_backward_reference"]
