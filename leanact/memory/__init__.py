"""Measuring what autograd keeps for backward."""
from .layer import LayerCost, measure_layer_cost
from .meter import SavedRecord, SavedTensorMeter, saved_bytes
from .peak import NewStoragePeak

__all__ = ["LayerCost", "NewStoragePeak", "SavedRecord", "SavedTensorMeter", "measure_layer_cost", "saved_bytes"]
