"""Grouped dense for MoE: tokens sorted by expert, ragged group sizes, one kernel and one set of slots per group.

Each group runs the dense op on its own rows (the others masked to zero), so per-tensor amaxes, blocks along
the token axis and gradients all see that group's tokens alone; groups may use different quantizers (some
hybrid, some not). This is the exact reference; grouped GPU kernels plug into the same contract.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ..recipes import DenseQuantizers
from .dense import dense


def group_masks(group_sizes, num_tokens: int):
    """[G, T] masks: row t belongs to group g when offsets[g] <= t < offsets[g+1]."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    t = jnp.arange(num_tokens)
    return (t[None, :] >= starts[:, None]) & (t[None, :] < ends[:, None])


def grouped_dense(x, kernels, group_sizes, *, quantizers: Sequence[DenseQuantizers], biases=None, key=None,
                  states: Sequence = None):
    """y[t] = x[t] @ kernels[g(t)] (+ biases[g(t)]) for x [T, K], kernels [G, K, N] (or a list of G kernels),
    group_sizes [G] summing to at most T (rows past the groups give zeros)."""
    num = len(kernels)
    if len(quantizers) != num:
        raise ValueError(f"grouped_dense: {num} kernels but {len(quantizers)} quantizer sets")
    if x.ndim != 2:
        raise ValueError(f"grouped_dense: x must be [tokens, features], got shape {tuple(x.shape)}")
    masks = group_masks(jnp.asarray(group_sizes), x.shape[0])
    y = None
    for g in range(num):
        m = masks[g][:, None].astype(x.dtype)
        b = None if biases is None else biases[g]
        st = None if states is None else states[g]
        kg = None if key is None else jax.random.fold_in(key, g)
        yg = dense(x * m, kernels[g], b, quantizers=quantizers[g], states=st, key=kg) * m
        y = yg if y is None else y + yg
    return y
