"""Grouped dense for MoE: tokens sorted by expert, ragged group sizes, one kernel and one set of slots per group.

Each group runs the dense op on its own rows, rolled to start at row 0 with the other rows zeroed, so
per-tensor amaxes, blocks along the token axis (the columnwise copies) and gradients see exactly that group's
tokens, as if the group were quantized alone. Groups may use different quantizers (some hybrid, some not).
This is the exact reference; grouped GPU kernels plug in behind the same contract.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ..recipes import DenseQuantizers
from .dense import dense


def grouped_dense(x, kernels, group_sizes, *, quantizers: Sequence[DenseQuantizers], biases=None, key=None,
                  states: Sequence = None):
    """y[t] = x[t] @ kernels[g(t)] (+ biases[g(t)]) for x [T, K] sorted by group, kernels [G, K, N] (or a list
    of G kernels), group_sizes [G] summing to at most T (rows past the last group give zeros)."""
    num = len(kernels)
    if len(quantizers) != num:
        raise ValueError(f"grouped_dense: {num} kernels but {len(quantizers)} quantizer sets")
    if x.ndim != 2:
        raise ValueError(f"grouped_dense: x must be [tokens, features], got shape {tuple(x.shape)}")
    sizes = jnp.asarray(group_sizes, jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    rows = jnp.arange(x.shape[0])
    y = None
    for g in range(num):
        mask = (rows < sizes[g])[:, None].astype(x.dtype)
        xg = jnp.roll(x, -starts[g], axis=0) * mask
        kg = None if key is None else jax.random.fold_in(key, g)
        yg = dense(xg, kernels[g], None if biases is None else biases[g], quantizers=quantizers[g],
                   states=None if states is None else states[g], key=kg) * mask
        yg = jnp.roll(yg, starts[g], axis=0)
        y = yg if y is None else y + yg
    return y
