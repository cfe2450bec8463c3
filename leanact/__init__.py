"""leanact: train Transformers in far less activation memory, with exact gradients."""
from . import functional, memory, nn, ops, recompute

__version__ = "0.1.0"
__all__ = ["functional", "memory", "nn", "ops", "recompute", "__version__"]
