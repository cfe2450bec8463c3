"""Functional API of leanact's memory-lean ops (mirrors ``torch.nn.functional``)."""
from .ops.attention import attention
from .ops.bitpack import pack_bits, packed_nbytes, unpack_bits
from .ops.dropout.function import dropout, dropout_seeded
from .ops.norms.dropout_add_norm import dropout_add_layer_norm
from .ops.gelu import gelu, gelu_minimum
from .ops.norms.layer_norm import layer_norm
from .ops.cross_entropy import linear_cross_entropy
from .ops.random import draw_seed, keep_mask, keep_mask_like
from .ops.norms.rms_norm import rms_norm

__all__ = [
    "attention", "draw_seed", "dropout", "dropout_add_layer_norm", "dropout_seeded", "gelu", "gelu_minimum",
    "keep_mask", "keep_mask_like", "layer_norm", "linear_cross_entropy", "pack_bits", "packed_nbytes", "rms_norm",
    "unpack_bits",
]
