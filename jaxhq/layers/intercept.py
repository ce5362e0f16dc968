"""`quantize_model(model, recipe)`: run an existing Flax linen model's nn.Dense, nn.DenseGeneral and nn.Einsum
calls through `jaxhq.ops.dense`, without editing the model.

The calls are intercepted with `nn.intercept_methods`: the interceptor creates the module's own parameters
(same names, shapes and initialisers, so the original params apply unchanged) and runs the GEMM under the
roles of the module's path. Everything else (embeddings, norms, attention math) runs as written. An Einsum
that is not a dense contraction (a letter shared by input, kernel and output, or summed within one operand)
and a DenseGeneral with batch_dims stay in high precision, with a warning.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..recipes import CustomRecipe, get
from .common import module_path, promote_dense
from .dense import general_dense, quantized_dense


def _dense(m: nn.Dense, recipe, x):
    kernel = m.param("kernel", m.kernel_init, (x.shape[-1], m.features), m.param_dtype)
    bias = m.param("bias", m.bias_init, (m.features,), m.param_dtype) if m.use_bias else None
    x, kernel, bias = promote_dense(m.dtype, x, kernel, bias)
    return quantized_dense(m, x, kernel, bias, recipe=recipe, path=module_path(m, "dense"))


def _dense_general(m: nn.DenseGeneral, recipe, x, next_fun, args, kwargs):
    if m.batch_dims:
        warnings.warn(f"quantize_model: {module_path(m, 'dense_general')!r} has batch_dims; left in high precision")
        return next_fun(*args, **kwargs)
    feats = (m.features,) if isinstance(m.features, int) else tuple(m.features)
    axes = tuple(a % x.ndim for a in ((m.axis,) if isinstance(m.axis, int) else m.axis))
    in_sizes = tuple(x.shape[a] for a in axes)
    init = m.kernel_init

    def flat_init(rng, shape, dtype=jnp.float32):
        return jnp.reshape(init(rng, (math.prod(in_sizes), math.prod(feats)), dtype), shape)

    kernel = m.param("kernel", flat_init, in_sizes + feats, m.param_dtype)
    bias = m.param("bias", m.bias_init, feats, m.param_dtype) if m.use_bias else None
    return general_dense(m, x, kernel, bias, axes, feats, recipe=recipe, dtype=m.dtype,
                         path=module_path(m, "dense_general"))


def _parse_einsum(spec: str, x_ndim: int, k_ndim: int):
    """(lhs, rhs, out) letters with any '...' expanded, or None when not a dense contraction."""
    lhs_rhs, out = spec.replace(" ", "").split("->")
    lhs, rhs = lhs_rhs.split(",")
    if "..." in rhs:
        return None
    if "..." in lhs:
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
        ell = "".join(free[:x_ndim - (len(lhs) - 3)])
        lhs, out = lhs.replace("...", ell), out.replace("...", ell)
    if len(lhs) != x_ndim or len(rhs) != k_ndim:
        return None
    batch = [c for c in lhs if c in out and c not in rhs]
    contract = [c for c in lhs if c in rhs and c not in out]
    feats = [c for c in rhs if c in out and c not in lhs]
    if sorted(batch + contract) != sorted(lhs) or sorted(contract + feats) != sorted(rhs) or \
            sorted(batch + feats) != sorted(out):
        return None
    return lhs, rhs, out, batch, contract, feats


def _einsum(m: nn.Einsum, recipe, x, next_fun, args, kwargs):
    spec = nn.merge_param("einsum_str", m.einsum_str, kwargs.get("einsum_str", args[1] if len(args) > 1 else None))
    parsed = _parse_einsum(spec, x.ndim, len(m.shape))
    if parsed is None:
        warnings.warn(f"quantize_model: einsum {spec!r} of {module_path(m, 'einsum')!r} is not a dense "
                      "contraction; left in high precision")
        return next_fun(*args, **kwargs)
    lhs, rhs, out, batch, contract, feats = parsed
    kernel = m.param("kernel", m.kernel_init, m.shape, m.param_dtype)
    bias, bshape = None, None
    if m.use_bias:
        shape, bshape = m._get_bias_shape(spec.replace(" ", ""), x, kernel)
        bias = m.param("bias", m.bias_init, shape, m.param_dtype)
    x, kernel, bias = promote_dense(m.dtype, x, kernel, bias)
    xt = jnp.transpose(x, [lhs.index(c) for c in batch + contract])
    kt = jnp.transpose(kernel, [rhs.index(c) for c in contract + feats])
    bdims, fdims = xt.shape[:len(batch)], kt.shape[len(contract):]
    k, n = math.prod(kt.shape[:len(contract)]), math.prod(fdims)
    y = quantized_dense(m, xt.reshape(*bdims, k), kt.reshape(k, n), None, recipe=recipe,
                        path=module_path(m, "einsum"))
    y = jnp.transpose(y.reshape(*bdims, *fdims), [(batch + feats).index(c) for c in out])
    if bias is not None:
        y = y + jnp.reshape(bias, bshape)
    return y


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
    """A Flax linen model whose Dense/DenseGeneral/Einsum calls run under `recipe`; `init` and `apply` take the
    model's own arguments and variables (params unchanged; "quant_state" added for delayed-scaling recipes)."""

    model: Any
    recipe: CustomRecipe

    def _intercept(self, next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or not isinstance(m, (nn.Dense, nn.DenseGeneral, nn.Einsum)):
            return next_fun(*args, **kwargs)
        x = args[0] if args else kwargs["inputs"]
        if isinstance(m, nn.Dense):
            return _dense(m, self.recipe, x)
        if isinstance(m, nn.DenseGeneral):
            return _dense_general(m, self.recipe, x, next_fun, args, kwargs)
        return _einsum(m, self.recipe, x, next_fun, args, kwargs)

    def init(self, *args, **kwargs):
        with nn.intercept_methods(self._intercept):
            return self.model.init(*args, **kwargs)

    def apply(self, *args, **kwargs):
        with nn.intercept_methods(self._intercept):
            return self.model.apply(*args, **kwargs)

    def clone(self, **kw) -> "QuantizedModel":
        return dataclasses.replace(self, **kw)


def quantize_model(model, recipe) -> QuantizedModel:
    """`model` (a flax.linen Module) with its dense/einsum GEMMs quantized by `recipe` (a CustomRecipe or a
    name): `quantize_model(model, recipe).apply(params, x)` works with the model's original params."""
    return QuantizedModel(model, get(recipe))
