"""Mixture-of-experts MLPs keeping only each routed token's gate/up outputs for backward: no dispatch
buffer, no activated product, no expert output.

- :mod:`.gated`: the gated experts (Mixtral, Qwen2/3-MoE), :func:`gated_experts`, and the routing
  both share (:func:`route`);
- :mod:`.clamped`: GPT-OSS's experts (biases, interleaved gate/up, clamped gating),
  :func:`clamped_experts`.
"""
from .clamped import ClampedExpertsFunction, clamped_experts
from .gated import GatedExpertsFunction, gated_experts, route

__all__ = ["GatedExpertsFunction", "gated_experts", "route", "ClampedExpertsFunction", "clamped_experts"]
