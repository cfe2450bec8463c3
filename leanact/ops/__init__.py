"""Autograd Functions that keep less for backward (the lowest layer of leanact)."""
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .dropout import dropout, dropout_seeded
from .gelu import gelu, gelu_minimum
from .layer_norm import layer_norm
from .random import draw_seed, keep_mask, keep_mask_like
from .rms_norm import rms_norm

__all__ = [
    "draw_seed", "dropout", "dropout_seeded", "gelu", "gelu_minimum", "keep_mask", "keep_mask_like",
    "layer_norm", "pack_bits", "packed_nbytes", "rms_norm", "unpack_bits",
]
