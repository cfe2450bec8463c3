"""leanact: train Transformers in far less activation memory, with exact gradients."""
from . import functional, lossy, memory, nn, ops, planner, recompute, strategies
from .estimate import Estimate, estimate, estimate_config, estimate_trainer
from ._version import __version__
from .patching import keep_logits, patch, summary, unpatch
from .planner import InfeasibleBudget, plan

__all__ = ["Estimate", "InfeasibleBudget", "estimate", "estimate_config", "estimate_trainer", "functional",
           "keep_logits", "lossy", "memory", "nn", "ops", "patch", "plan", "planner", "recompute", "strategies",
           "summary", "unpatch", "__version__"]
