"""LayerNormMLP: norm -> fc1 -> activation (gelu, silu, or gated swiglu/geglu) -> fc2, both GEMMs quantized.

The activation is fc1's (`Dense(activation=...)`): fc1's backward quantizes its output gradient from the
activation's input and gradient, without writing that gradient where a kernel takes them (jaxhq.ops.activation).

fc1 and fc2 are jaxhq Dense modules ("<path>.fc1", "<path>.fc2"). The fc1-output/fc2-input boundary is the
fc2 `input` role, used once: fc1's output slot is wired to it and fc2 quantizes the activation; the same for
the gradient (fc2's grad-input boundary is fc1's grad_output role). Gated activations double fc1's width
and split it in halves: act(first half) * second half.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from ..ops.activation import check as check_activation, is_gated
from ..recipes import CustomRecipe
from ..roles import QuantizerRole, gemm_roles
from .common import child_path, make_norm
from .dense import Dense, default_kernel_init



class LayerNormMLP(nn.Module):
    """Pre-norm MLP block (no residual): fc2(act(fc1(norm(x)))); `norm=None` skips the norm."""

    d_ff: int
    recipe: CustomRecipe
    activation: str = "gelu"
    norm: Optional[str] = "layernorm"
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    output_role: Optional[QuantizerRole] = None
    grad_input_role: Optional[QuantizerRole] = None

    @nn.compact
    def __call__(self, x):
        check_activation(self.activation)
        fc1_roles, fc2_roles = gemm_roles(child_path(self, "fc1")), gemm_roles(child_path(self, "fc2"))
        h = make_norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(x) if self.norm else x
        width = self.d_ff * (2 if is_gated(self.activation) else 1)
        common = dict(recipe=self.recipe, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_init=self.kernel_init)
        h = Dense(width, kernel_axes=("embed", "mlp"), output_role=fc2_roles["input"],
                  grad_input_role=self.grad_input_role, activation=self.activation, name="fc1", **common)(h)
        return Dense(x.shape[-1], kernel_axes=("mlp", "embed"), output_role=self.output_role,
                     grad_input_role=fc1_roles["grad_output"], name="fc2", **common)(h)
