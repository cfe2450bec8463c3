"""The down projection of a gated MLP, ``linear(act(g) * u, W, b)`` (SwiGLU, GeGLU), keeping only g
and u for backward: act(g) and the product are rebuilt there.

- :mod:`.function`: the autograd Function (and the custom op ``torch.compile`` traces),
  :func:`gated_down`, the activations (:func:`gated_act`, :func:`act_grad`, which the MoE experts of
  :mod:`leanact.ops.moe` share) and the registration of the kernels' self-check;
- :mod:`.launchers` and :mod:`.kernels`: the Triton path on CUDA (``act(g) * u`` each way).
"""
from .function import GATED_ACTIVATIONS, GatedDownFunction, act_grad, gated_act, gated_down

__all__ = ["GATED_ACTIVATIONS", "GatedDownFunction", "gated_down", "gated_act", "act_grad"]
