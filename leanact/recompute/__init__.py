"""Keep a recipe instead of a cheap producer's output (norm→linear fusion, lean MLP).

``RecipeTransform`` (a leanact saved-tensor transform) replaces what consumers would keep of a
producer's output (norm, activation, seeded dropout: :mod:`.producers`) by a recipe rebuilding
it in backward from tensors the producer keeps anyway. ``scope(module)`` activates it around a
module's forward. Modules: :mod:`leanact.nn.fused`.
"""
from . import producers
from .producers import activation, cast, dropout, gelu, layer_norm, quick_gelu, relu, rms_norm, silu, swiglu
from .recipes import (Recipe, RecipeTransform, cached_bytes, counters, is_active, live_recipes, register,
                      reset_counters, scope)

__all__ = ["Recipe", "RecipeTransform", "activation", "cached_bytes", "cast", "counters", "dropout", "gelu",
           "is_active", "layer_norm", "live_recipes", "producers", "quick_gelu", "register", "relu", "reset_counters",
           "rms_norm", "scope", "silu", "swiglu"]
