"""Activation recompute for transformer layers: none, full, or saving only the quantized residuals.

"quantized" keeps what the dense op's backward reads (the columnwise FP8/FP4 copies and their scales, tagged
`QUANTIZED_RESIDUAL` by the op) and recomputes everything else, so a layer's saved activations are the
low-precision bytes only; "offload" keeps the same residuals in host memory. "full" saves nothing.
"""
from __future__ import annotations

import jax
import flax.linen as nn

from ..ops.dense import QUANTIZED_RESIDUAL

POLICIES = ("none", "full", "quantized", "offload")


def quantized_residuals_policy():
    """A `jax.checkpoint` policy that saves only the values tagged as quantized residuals."""
    return jax.checkpoint_policies.save_only_these_names(QUANTIZED_RESIDUAL)


def offload_quantized_residuals_policy():
    """Like `quantized_residuals_policy`, but the quantized residuals go to host memory ("pinned_host") between
    the forward and the backward pass, where the platform has it (on the CPU the path runs, nothing moves)."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[QUANTIZED_RESIDUAL],
        offload_src="device", offload_dst="pinned_host")


def remat_layer(layer_cls, policy: str = "none"):
    """The layer class wrapped in `nn.remat` by policy name; `deterministic` (argument 3) stays static."""
    if policy not in POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; expected one of {POLICIES}")
    if policy == "none":
        return layer_cls
    pol = {"full": None, "quantized": quantized_residuals_policy(),
           "offload": offload_quantized_residuals_policy()}[policy]
    return nn.remat(layer_cls, policy=pol, static_argnums=(3,))
