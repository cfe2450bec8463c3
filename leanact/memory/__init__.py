"""Measuring what autograd keeps for backward."""
from .meter import SavedRecord, SavedTensorMeter, saved_bytes

__all__ = ["SavedRecord", "SavedTensorMeter", "saved_bytes"]
