"""Global amax: the max |x| of a sharded tensor over every mesh axis it is split on, NaN-preserving.

Under jit with NamedSharding nothing is needed: `jnp.max` of a sharded array is global (the partitioner adds
the max all-reduce), so the per-tensor formats' amaxes (current and delayed scaling, forward and backward,
NVFP4's global scale) already agree on every device. Inside `shard_map` a function sees only its shard:
`global_amax(x, axes)` reduces the local amaxes with `pmax` over the named axes.
"""
from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp

from ..formats.base import abs_bits, abs_max, canonical_nan


def pmax_nan(a, axis_names: Union[str, Sequence[str]]):
    """`jax.lax.pmax` of non-negative amaxes that is NaN when any device's is NaN: one max all-reduce of the float32
    bit patterns (sign cleared), which order as the values do with every NaN above Inf, as in
    formats.base.abs_max (a float max all-reduce may drop NaNs: the CPU backend's does); the canonical NaN."""
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if not names:
        return a
    m = jax.lax.bitcast_convert_type(jax.lax.pmax(abs_bits(a.astype(jnp.float32)), names), jnp.float32)
    return canonical_nan(m).astype(a.dtype)  # scalars: the result stays replicated


def global_amax(x, axis_names: Union[str, Sequence[str]] = ()):
    """max |x| (float32) over x and, inside shard_map, over the mesh axes `axis_names` x is split on.

    NaN anywhere gives NaN everywhere (see `pmax_nan`).
    """
    return pmax_nan(abs_max(x).astype(jnp.float32), axis_names)
