"""Drop-in torch.nn modules built on leanact.ops (same arguments, attributes, state_dict keys)."""
from .activation import GELU
from .dropout import Dropout
from .normalization import LayerNorm, RMSNorm

__all__ = ["Dropout", "GELU", "LayerNorm", "RMSNorm"]
