"""Autograd Functions that keep less for backward (the lowest layer of leanact).

One file per op (``leanact.ops.gelu``, ``.layer_norm``, ``.rms_norm``, ``.dropout``, ...); the
functional API collecting them is :mod:`leanact.functional`.
"""
