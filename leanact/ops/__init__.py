"""Autograd Functions that keep less for backward (the lowest layer of leanact)."""
from .bitpack import pack_bits, packed_nbytes, unpack_bits

__all__ = ["pack_bits", "packed_nbytes", "unpack_bits"]
