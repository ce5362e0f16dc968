"""Grouped dense for MoE: tokens sorted by expert, ragged group sizes, one kernel and one set of slots per group.

Each group runs the dense op on its own rows starting at row 0 with zero rows after them, so per-tensor
amaxes, blocks along the token axis (the columnwise copies) and gradients see exactly that group's tokens, as
if the group were quantized alone. Two dispatches build those per-group rows: "capacity" (the default) copies
group g's rows into a fixed buffer xs[g] of `capacity` rows (a multiple of 128, so token-axis blocks of every
format stay whole; rows past the capacity are dropped, their output 0), "replicated" rolls the whole [T, K]
input per group (every group, hence every expert rank, gets all T rows). With capacity >= the largest group
both give the same bits (NVFP4 stochastic rounding aside: its random draws depend on the buffer's length, so
its wgrad matches bit for bit only when capacity == T). Groups may use different quantizers (some hybrid, some not). When every group has
the same quantizers (roles aside) and the kernels are one stacked array, the groups run as one vmap over the
experts; with an ExpertSharding that vmap is split on the expert mesh axis (expert parallelism, see
jaxhq/sharding/experts.py). This is the exact reference; grouped GPU kernels plug in behind the same contract.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from ..recipes import DenseQuantizers
from .dense import dense

ROW_BLOCK = 128  # capacities are multiples of this: it is a multiple of every format's block along tokens
DISPATCHES = ("capacity", "replicated")


def round_rows(n: int) -> int:
    """n rounded up to a whole number of ROW_BLOCK rows (at least one block)."""
    return max(1, -(-int(n) // ROW_BLOCK)) * ROW_BLOCK


def expert_capacity(tokens: int, num_experts: int, top_k: int = 1, capacity_factor: Optional[float] = None) -> int:
    """Rows per expert buffer for `tokens` tokens routed to `top_k` of `num_experts` experts each.

    None: round_rows(tokens), enough for any routing (a token picks an expert at most once), nothing dropped.
    capacity_factor f: round_rows(ceil(f * tokens * top_k / num_experts)); an expert picked by more tokens
    drops the last ones in sorted order (their output rows are 0)."""
    if capacity_factor is None:
        return round_rows(tokens)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return round_rows(math.ceil(capacity_factor * tokens * top_k / num_experts))


def _starts(group_sizes):
    sizes = jnp.asarray(group_sizes, jnp.int32)
    return sizes, jnp.cumsum(sizes) - sizes


def to_experts(x, group_sizes, capacity: int):
    """x [T, K] sorted by group -> xs [G, capacity, K]: row i of group g at xs[g, i], zeros past the group,
    rows past the capacity dropped."""
    sizes, starts = _starts(group_sizes)
    i = jnp.arange(capacity)
    src = jnp.clip(starts[:, None] + i, 0, x.shape[0] - 1)
    keep = (i < sizes[:, None])[..., None]
    return jnp.where(keep, x[src], jnp.zeros((), x.dtype))


def from_experts(ys, group_sizes, rows: int):
    """The inverse of to_experts: ys [G, C, N] -> y [rows, N] sorted by group; dropped rows and rows past the
    last group are 0."""
    sizes, starts = _starts(group_sizes)
    t = jnp.arange(rows)
    g = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), t, side="right"), 0, sizes.shape[0] - 1)
    pos = t - starts[g]
    keep = ((pos < sizes[g]) & (pos < ys.shape[1]))[:, None]
    return jnp.where(keep, ys[g, jnp.clip(pos, 0, ys.shape[1] - 1)], jnp.zeros((), ys.dtype))


def _shared(quantizers: Sequence[DenseQuantizers]):
    """The quantizers every group shares (the first group's, with its roles for error messages), or None."""
    plain = {dataclasses.replace(q, roles=None) for q in quantizers}
    return quantizers[0] if len(plain) == 1 else None


def grouped_dense(x, kernels, group_sizes=None, *, quantizers: Sequence[DenseQuantizers], biases=None, key=None,
                  states: Sequence = None, expert_sharding=None, dispatch: str = "capacity",
                  capacity: Optional[int] = None):
    """y[t] = x[t] @ kernels[g(t)] (+ biases[g(t)]) for x [T, K] sorted by group, kernels [G, K, N] (or a list
    of G kernels), group_sizes [G] summing to at most T (rows past the last group give zeros).

    x [G, C, K] with group_sizes None: rows already in per-group buffers (zeros past each group's rows, as
    to_experts makes them); returns [G, C, N]. dispatch: "capacity" (default; capacity None: round_rows(T),
    exact) or "replicated" (the former dispatch: every group gets all T rows), see the module docstring.
    expert_sharding: a jaxhq.sharding.ExpertSharding (or None) for kernels split on an expert mesh axis; the
    experts are split when the kernels are one stacked array and every group has the same quantizers (else
    they run one by one, with a warning).
    """
    num = len(kernels)
    if len(quantizers) != num:
        raise ValueError(f"grouped_dense: {num} kernels but {len(quantizers)} quantizer sets")
    if dispatch not in DISPATCHES:
        raise ValueError(f"grouped_dense: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if x.ndim == 3 and group_sizes is None:
        if x.shape[0] != num:
            raise ValueError(f"grouped_dense: x of shape {tuple(x.shape)} holds {x.shape[0]} groups, not {num}")
        return _experts(x, kernels, quantizers, biases, key, states, expert_sharding)
    if x.ndim != 2:
        raise ValueError(f"grouped_dense: x must be [tokens, features] (or [groups, rows, features] without "
                         f"group_sizes), got shape {tuple(x.shape)}")
    rows = x.shape[0]
    if dispatch == "capacity":
        xs = to_experts(x, group_sizes, round_rows(rows) if capacity is None else capacity)
        return from_experts(_experts(xs, kernels, quantizers, biases, key, states, expert_sharding),
                            group_sizes, rows)
    sizes, starts = _starts(group_sizes)
    live = jnp.arange(rows)[None, :] < sizes[:, None]  # [G, T]: group g's rows once rolled to row 0

    def take(g):  # group g's rows rolled to row 0, the others zero
        return jnp.roll(x, -starts[g], axis=0) * live[g][:, None].astype(x.dtype)

    def put(yg, g):  # back to group g's rows, zero elsewhere
        return jnp.roll(yg * live[g][:, None].astype(yg.dtype), starts[g], axis=0)

    gs = jnp.arange(num)
    ys = _experts(jax.vmap(take)(gs), kernels, quantizers, biases, key, states, expert_sharding)
    return jnp.sum(jax.vmap(put)(ys, gs), axis=0)


def _experts(xs, kernels, quantizers, biases, key, states, expert_sharding):
    """ys[g] = dense(xs[g], kernels[g]) for per-group rows xs [G, R, K]: one vmap over the experts (split on
    the expert mesh axis with an ExpertSharding) when they share quantizers, else a loop."""
    num = len(kernels)

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
                          stacklevel=3)
    if shared is None:
        return jnp.stack([dense(xs[g], kernels[g], None if biases is None else biases[g], quantizers=quantizers[g],
                                states=None if states is None else states[g], key=group_key(g))
                          for g in range(num)])

    gs = jnp.arange(num)
    ws, axis = None, None
    if expert_sharding is not None:
        xs = expert_sharding.constrain_groups(xs)
        ws, axis = expert_sharding.kernel, expert_sharding.spmd_axis_name
    stacked = None if states is None else jax.tree.map(lambda *s: jnp.stack(s), *states)
    keys = None if key is None else jax.vmap(group_key)(gs)

    def one(xg, kg, bg, key_g, st):
        return dense(xg, kg, bg, quantizers=shared, states=st, key=key_g, weight_sharding=ws)

    return jax.vmap(one, in_axes=(0, 0, None if biases is None else 0, None if keys is None else 0,
                                  None if stacked is None else 0), spmd_axis_name=axis)(
        xs, kernels, biases, keys, stacked)
