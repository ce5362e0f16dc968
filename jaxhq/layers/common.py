"""Shared plumbing of the jaxhq layers: module paths (role names), the "quant" rng, norms, shape checks.

A role's name is the module's full path in the model ("layers_0.attn.qkv"); a top-level module that has no
path uses its class default name. Norms are Flax's own `nn.LayerNorm` / `nn.RMSNorm`, so under `bf16()` a
jaxhq layer is bit-identical to the plain Flax layers with the same parameters.
"""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from ..formats import COLUMNWISE, ROWWISE, QuantizationError, side
from ..recipes import DenseQuantizers

NORMS = ("layernorm", "rmsnorm")


def module_path(m: nn.Module, default: str) -> str:
    """The module's path joined by "." (its role name); `default` for a top-level module."""
    path = tuple(str(p) for p in m.scope.path) if m.scope is not None else ()
    return ".".join(path) or default


def child_path(m: nn.Module, child: str) -> str:
    """The path a submodule named `child` of `m` will have (so a parent can wire roles before building it)."""
    path = tuple(str(p) for p in m.scope.path) if m.scope is not None else ()
    return ".".join(path + (child,))


def quant_key(m: nn.Module):
    """A key from the "quant" rng stream (stochastic rounding) when the caller gave one, else None."""
    return m.make_rng("quant") if m.has_rng("quant") else None


def make_norm(kind: str, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32, name: str = "norm"):
    """Flax's LayerNorm or RMSNorm, with its parameters on the logical axis "embed"."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; expected one of {NORMS}")
    scale = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    if kind == "rmsnorm":
        return nn.RMSNorm(epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=scale, name=name)
    bias = nn.with_logical_partitioning(nn.initializers.zeros, ("embed",))
    return nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=scale, bias_init=bias,
                        name=name)


def check_feature_shapes(qs: DenseQuantizers, path: str, rows: int, k: int, n: int) -> None:
    """Trace-time check of every copy whose blocked axis is a feature axis (not the token axis), so a feature
    size the format cannot take fails at init with the layer's name, not deep inside the backward pass."""
    copies = (("input", ROWWISE, rows, k), ("weight", ROWWISE, n, k), ("weight", COLUMNWISE, k, n),
              ("grad_output", ROWWISE, rows, n))
    for slot, axis, r, c in copies:
        q = side(getattr(qs, slot), axis)
        try:
            q.check_shape(r, c, axis)
        except QuantizationError as e:
            raise QuantizationError(f"layer {path!r}: {slot} ({qs.role(slot)}), {axis} copy [{r}, {c}] with "
                                    f"{q.label}: {e}") from None


def promote(dtype: Optional[object], *arrays):
    """Cast arrays (None kept) to `dtype`, or to their common type as flax's promote_dtype does."""
    present = [a for a in arrays if a is not None]
    dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(*present)
    return tuple(None if a is None else jnp.asarray(a, dt) for a in arrays)


def promote_dense(dtype: Optional[object], x, kernel, bias=None):
    """`promote` for the dense op's arguments, except the kernel, which stays in its parameter dtype: the op makes
    the weight's copies of kernel.astype(x.dtype), and the quantize kernels round the master values as they read
    them, so that cast is not written to memory (see jaxhq.ops.dense)."""
    x, _, bias = promote(dtype, x, kernel, bias)
    return x, kernel, bias
