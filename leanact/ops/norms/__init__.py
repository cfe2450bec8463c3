"""The lean norms: LayerNorm, RMSNorm and a sub-layer's end (dropout + residual add + LayerNorm)
that keep their output y and one rstd per row for backward instead of their input.

- :mod:`.layer_norm`, :mod:`.rms_norm`, :mod:`.dropout_add_norm`: the autograd Functions, their
  PyTorch paths and the registration of their kernels' self-checks;
- :mod:`.verdict`: whether y determines x̂ for given γ, β (the rule), cached per weight and
  confirmed by a deferred check; :mod:`.batch_check`: the rule for many norms in one pass and one
  sync (or none: deferred); :mod:`.step_bound`: how far Adam/AdamW steps can move γ, β, which lets a
  passing verdict stand between checks;
- :mod:`.launchers` and :mod:`.kernels`: the Triton path on CUDA.
"""
from .dropout_add_norm import DropoutAddLayerNorm, dropout_add_layer_norm
from .layer_norm import LayerNormFromOutput, layer_norm
from .rms_norm import RMSNormFunction, rms_norm
from .verdict import DEFAULT_MAX_RATIO, clear_decision_cache, confirm_verdicts, from_output_ok, use_step_bound

__all__ = ["layer_norm", "rms_norm", "dropout_add_layer_norm", "LayerNormFromOutput", "RMSNormFunction",
           "DropoutAddLayerNorm", "from_output_ok", "clear_decision_cache", "confirm_verdicts", "use_step_bound",
           "DEFAULT_MAX_RATIO"]
