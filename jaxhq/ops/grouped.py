"""Grouped dense for MoE: tokens sorted by expert, ragged group sizes, one kernel and one set of slots per group.

Each group runs the dense op on its own rows, rolled to start at row 0 with the other rows zeroed, so
per-tensor amaxes, blocks along the token axis (the columnwise copies) and gradients see exactly that group's
tokens, as if the group were quantized alone. Groups may use different quantizers (some hybrid, some not).
When every group has the same quantizers (roles aside) and the kernels are one stacked array, the groups run
as one vmap over the experts; with an ExpertSharding that vmap is split on the expert mesh axis (expert
parallelism: each device computes its own experts, see jaxhq/sharding/experts.py). This is the exact
reference; grouped GPU kernels plug in behind the same contract.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp

from ..recipes import DenseQuantizers
from .dense import dense


def _shared(quantizers: Sequence[DenseQuantizers]):
    """The quantizers every group shares (the first group's, with its roles for error messages), or None."""
    plain = {dataclasses.replace(q, roles=None) for q in quantizers}
    return quantizers[0] if len(plain) == 1 else None


def grouped_dense(x, kernels, group_sizes, *, quantizers: Sequence[DenseQuantizers], biases=None, key=None,
                  states: Sequence = None, expert_sharding=None):
    """y[t] = x[t] @ kernels[g(t)] (+ biases[g(t)]) for x [T, K] sorted by group, kernels [G, K, N] (or a list
    of G kernels), group_sizes [G] summing to at most T (rows past the last group give zeros).

    expert_sharding: a jaxhq.sharding.ExpertSharding (or None) for kernels split on an expert mesh axis; the
    experts are split when the kernels are one stacked array and every group has the same quantizers (else
    they run one by one, with a warning).
    """
    num = len(kernels)
    if len(quantizers) != num:
        raise ValueError(f"grouped_dense: {num} kernels but {len(quantizers)} quantizer sets")
    if x.ndim != 2:
        raise ValueError(f"grouped_dense: x must be [tokens, features], got shape {tuple(x.shape)}")
    sizes = jnp.asarray(group_sizes, jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    rows = jnp.arange(x.shape[0])

    def take(g):  # group g's rows rolled to row 0, the others zero
        return jnp.roll(x, -starts[g], axis=0) * (rows < sizes[g])[:, None].astype(x.dtype)

    def put(yg, g):  # back to group g's rows, zero elsewhere
        return jnp.roll(yg * (rows < sizes[g])[:, None].astype(yg.dtype), starts[g], axis=0)

    def group_key(g):
        return None if key is None else jax.random.fold_in(key, g)

    shared = _shared(quantizers) if not isinstance(kernels, (list, tuple)) else None
    if expert_sharding is not None:
        expert_sharding.check(num)
        if shared is None:
            who = quantizers[0].role("weight") if quantizers[0].roles else "grouped dense"
            warnings.warn(f"{who}: the experts have different quantizers (or the kernels are not one stacked "
                          "array), so they run one by one and XLA moves each expert's kernel, unquantized, to "
                          "every device; give the experts of one layer the same formats for expert parallelism",
                          stacklevel=2)
    if shared is None:
        y = None
        for g in range(num):
            yg = dense(take(g), kernels[g], None if biases is None else biases[g], quantizers=quantizers[g],
                       states=None if states is None else states[g], key=group_key(g))
            y = put(yg, g) if y is None else y + put(yg, g)
        return y

    gs = jnp.arange(num)
    xs = jax.vmap(take)(gs)
    ws, axis = None, None
    if expert_sharding is not None:
        xs = expert_sharding.constrain_groups(xs)
        ws, axis = expert_sharding.kernel, expert_sharding.spmd_axis_name
    stacked = None if states is None else jax.tree.map(lambda *s: jnp.stack(s), *states)
    keys = None if key is None else jax.vmap(group_key)(gs)

    def one(xg, kg, bg, key_g, st):
        return dense(xg, kg, bg, quantizers=shared, states=st, key=key_g, weight_sharding=ws)

    ys = jax.vmap(one, in_axes=(0, 0, None if biases is None else 0, None if keys is None else 0,
                                None if stacked is None else 0), spmd_axis_name=axis)(
        xs, kernels, biases, keys, stacked)
    return jnp.sum(jax.vmap(put)(ys, gs), axis=0)
