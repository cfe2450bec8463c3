"""Predict the memory of one training step on fake tensors (``leanact.estimate``), and measure it
on real ones with the same protocol (:func:`measure`) to check the prediction."""
from leanact.planner import register_maximizer

from .api import CUDA_NOTES, estimate, estimate_config
from .maximize import Maximized, maximize
from .measure import measure
from .result import Estimate
from .trainer import estimate_trainer, measure_trainer

register_maximizer(maximize)  # leanact.plan(..., maximize="seq"|"batch")

__all__ = ["CUDA_NOTES", "Estimate", "Maximized", "estimate", "estimate_config", "estimate_trainer", "maximize",
           "measure", "measure_trainer"]
