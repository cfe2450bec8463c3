"""Small reference models built from swappable modules (for profiling and benchmarks)."""
from .encoder import EncoderLayer, EncoderStack, ModuleSet, TORCH_MODULES, leanact_modules

__all__ = ["EncoderLayer", "EncoderStack", "ModuleSet", "TORCH_MODULES", "leanact_modules"]
