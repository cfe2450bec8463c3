"""Predict the memory of one training step on fake tensors (``leanact.estimate``), and measure it
on real ones with the same protocol (:func:`measure`) to check the prediction."""
from .api import CUDA_NOTES, estimate, estimate_config
from .measure import measure
from .result import Estimate

__all__ = ["CUDA_NOTES", "Estimate", "estimate", "estimate_config", "measure"]
