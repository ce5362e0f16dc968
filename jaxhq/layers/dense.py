"""Dense, DenseGeneral and LayerNormDense: Flax modules whose GEMM runs through `jaxhq.ops.dense` under a recipe.

Each module's slots are `jaxhq.roles.dense_slots(path)` (input, weight, output boundary; grad_output,
grad-input boundary); the parent may wire the boundaries (`output_role`, `grad_input_role`) to the roles of
the tensor's consumer, e.g. LayerNormMLP wires fc1's output to fc2's input. A boundary is only a label: the
consumer quantizes the tensor, so each role is used once. Parameters have Flax's names and layouts
("kernel" [in, out], "bias"), so a plain `nn.Dense` checkpoint loads as is.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp

from .. import ops
from ..ops.dense import takes_kernel_amax
from ..recipes import CustomRecipe
from ..roles import QuantizerRole, dense_slots
from . import introspect, state
from .common import check_feature_shapes, make_norm, module_path, promote_dense, quant_key

default_kernel_init = nn.initializers.lecun_normal()


def _weight_sharding(kernel_axes, path):
    """The FSDP hook of the dense op for the current mesh (None without a mesh or without axis names)."""
    if not kernel_axes:
        return None
    from ..sharding import weight_sharding
    return weight_sharding(tuple(kernel_axes), path)


def quantized_dense(m: nn.Module, x, kernel, bias, *, recipe: CustomRecipe, path: str, kernel_axes=None,
                    output_role: Optional[QuantizerRole] = None, grad_input_role: Optional[QuantizerRole] = None,
                    module_type: str = "linear", activation: Optional[str] = None):
    """`x @ kernel + bias` through `jaxhq.ops.dense` with the roles of `path`, from inside module `m` (which
    owns the delayed-scaling state, the "quant" rng and the "weight_amax" entry of its "kernel"), then
    `activation` if given. kernel is 2D [in, out]: m's "kernel" parameter, cast, reshaped or transposed (its
    amax, where the collection holds it, is that parameter's)."""
    rows = math.prod(x.shape[:-1])
    introspect.record(path, dense_slots(path, output_role, grad_input_role, module_type,
                                        activation if bias is None else None,  # a bias keeps XLA's gradient
                                        rows * kernel.shape[-1]))
    qs = recipe.dense_quantizers(path, module_type)
    check_feature_shapes(qs, path, rows, kernel.shape[0], kernel.shape[1])
    svars = state.dense_state_vars(m, qs)
    kw = {}
    wsh = _weight_sharding(kernel_axes, path)
    if wsh is not None:
        kw["weight_sharding"] = wsh
    kw["kernel_amax"] = state.weight_amax(m, takes_kernel_amax(qs.weight))
    y, new = ops.dense(x, kernel, bias, quantizers=qs, states=state.values(svars), key=quant_key(m),
                       return_state=True, activation=activation, **kw)
    state.write_forward(m, svars, new)
    return y


class Dense(nn.Module):
    """`y = x @ kernel + bias` over the last axis, quantized per the recipe's roles for this module's path.

    activation: an activation of jaxhq.ops.activation.ACTIVATIONS applied to y (a gated one halves the features);
    the backward then quantizes y's gradient without writing it (see `jaxhq.ops.dense`)."""

    features: int
    recipe: CustomRecipe
    use_bias: bool = True
    kernel_axes: Tuple[str, str] = ("embed", "mlp")
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros
    output_role: Optional[QuantizerRole] = None
    grad_input_role: Optional[QuantizerRole] = None
    activation: Optional[str] = None

    @nn.compact
    def __call__(self, x):
        return self._dense(x, "dense")

    def _dense(self, x, module_type: str):
        kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                            (x.shape[-1], self.features), self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, self.kernel_axes[1:]),
                              (self.features,), self.param_dtype)
        x, kernel, bias = promote_dense(self.dtype, x, kernel, bias)
        return quantized_dense(self, x, kernel, bias, recipe=self.recipe, path=module_path(self, module_type),
                               kernel_axes=self.kernel_axes, output_role=self.output_role,
                               grad_input_role=self.grad_input_role, activation=self.activation)


def _axes_tuple(axis, ndim):
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axis)


def _fused(names):
    return names[0] if len(names) == 1 else tuple(names)


class DenseGeneral(nn.Module):
    """Dense over several input axes (`axis`) to several output features (a tuple), like `nn.DenseGeneral`:
    the contracted axes and the features are flattened into one GEMM [tokens, K] x [K, N]. Kernel layout
    (*in_sizes, *features), initialised on its flattened 2D shape as Flax does."""

    features: Union[int, Sequence[int]]
    recipe: CustomRecipe
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    kernel_axes: Optional[Tuple] = None  # one logical name per kernel dim (None: unnamed)
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros
    output_role: Optional[QuantizerRole] = None
    grad_input_role: Optional[QuantizerRole] = None

    @nn.compact
    def __call__(self, x):
        feats = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axes = _axes_tuple(self.axis, x.ndim)
        in_sizes = tuple(x.shape[a] for a in axes)
        names = self.kernel_axes or (None,) * (len(in_sizes) + len(feats))
        if len(names) != len(in_sizes) + len(feats):
            raise ValueError(f"DenseGeneral {module_path(self, 'dense_general')!r}: kernel_axes {names} must name "
                             f"{len(in_sizes) + len(feats)} kernel dims {in_sizes + feats}")
        init = self.kernel_init

        def flat_init(rng, shape, dtype=jnp.float32):
            return jnp.reshape(init(rng, (math.prod(in_sizes), math.prod(feats)), dtype), shape)

        kernel = self.param("kernel", nn.with_logical_partitioning(flat_init, names), in_sizes + feats,
                            self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, names[len(in_sizes):]), feats,
                              self.param_dtype)
        return general_dense(self, x, kernel, bias, axes, feats, recipe=self.recipe, dtype=self.dtype,
                             path=module_path(self, "dense_general"),
                             kernel_axes=(_fused(names[:len(in_sizes)]), _fused(names[len(in_sizes):]))
                             if self.kernel_axes else None,
                             output_role=self.output_role, grad_input_role=self.grad_input_role)


def general_dense(m, x, kernel, bias, axes, feats, *, recipe, dtype, path, kernel_axes=None, **roles):
    """Contract x's `axes` with the kernel's leading dims; output batch dims (x's others, in order) + feats."""
    x, kernel, bias = promote_dense(dtype, x, kernel, bias)
    batch = [a for a in range(x.ndim) if a not in axes]
    xt = jnp.transpose(x, batch + list(axes))
    bshape = xt.shape[:len(batch)]
    k = math.prod(kernel.shape[:len(axes)])
    n = math.prod(feats)
    y = quantized_dense(m, xt.reshape(*bshape, k), kernel.reshape(k, n),
                        None if bias is None else bias.reshape(n), recipe=recipe, path=path,
                        kernel_axes=kernel_axes, **roles)
    return y.reshape(*bshape, *feats)


class LayerNormDense(Dense):
    """A norm (LayerNorm or RMSNorm, Flax's own) fused in front of a Dense: `Dense(norm(x))`; the norm's
    parameters live under "norm", the kernel and bias at this module's level."""

    norm: str = "layernorm"
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x):
        return self._dense(make_norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(x), "layernorm_dense")
