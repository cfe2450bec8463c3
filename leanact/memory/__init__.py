"""Measuring what autograd keeps for backward."""
from .layer import LayerCost, measure_layer_cost
from .meter import SavedRecord, SavedTensorMeter, saved_bytes

__all__ = ["LayerCost", "SavedRecord", "SavedTensorMeter", "measure_layer_cost", "saved_bytes"]
