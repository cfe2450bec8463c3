"""leanact: train Transformers in far less activation memory, with exact gradients."""
from . import functional, memory, nn, ops, plan, recompute, strategies
from .patching import patch, summary, unpatch

__version__ = "0.1.0"
__all__ = ["functional", "memory", "nn", "ops", "patch", "plan", "recompute", "strategies", "summary", "unpatch",
           "__version__"]
