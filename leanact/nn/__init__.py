"""Drop-in torch.nn modules built on leanact.ops (same arguments, attributes, state_dict keys)."""
from .activation import GELU
from .attention import AttentionCore
from .dropout import Dropout
from .fused import LayerNormLinears, LeanMLP
from .loss import LinearCrossEntropyLoss
from .normalization import LayerNorm, RMSNorm
from .transformer import TransformerEncoderLayer

__all__ = ["AttentionCore", "Dropout", "GELU", "LayerNorm", "LayerNormLinears", "LeanMLP", "LinearCrossEntropyLoss",
           "RMSNorm", "TransformerEncoderLayer"]
