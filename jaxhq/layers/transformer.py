"""TransformerLayer: pre-norm decoder block, x + attn(norm(x)) then + mlp(norm(.)) or + moe(norm(.)).

The norms are fused into the first GEMM of each branch (attn.qkv is a LayerNormDense, mlp a LayerNormMLP),
attention has rotary embeddings and GQA, and `moe` (a MoEConfig) swaps the MLP for a mixture of experts.
Roles: "<path>.attn.{qkv,dpa,proj}", "<path>.mlp.{fc1,fc2}" or "<path>.moe.experts_<g>.{fc1,fc2}".
Under a mesh the residual stream is constrained to (batch, length, embed), so the rules decide where it lives
(with `axis_rules(sequence_parallel=True)`, split on length over the tensor axis: the norms run on each device's
tokens, qkv and fc1 gather their quantized inputs, proj and fc2 reduce-scatter their outputs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from ..recipes import CustomRecipe
from ..sharding.rules import constrain
from .attention import MultiHeadAttention
from .dense import default_kernel_init
from .mlp import LayerNormMLP
from .moe import MoE


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings of a TransformerLayer; d_ff None: the layer's d_ff per expert; dispatch: MoE's
    ("capacity", "replicated" or "grouped")."""

    num_experts: int = 4
    top_k: int = 2
    d_ff: Optional[int] = None
    dispatch: str = "capacity"


class TransformerLayer(nn.Module):
    num_heads: int
    d_ff: int
    recipe: CustomRecipe
    num_kv_heads: Optional[int] = None
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    moe: Optional[MoEConfig] = None
    rotary: bool = True
    causal: bool = True
    epsilon: float = 1e-6
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    attention_implementation: Optional[str] = None  # high-precision attention: "xla", "cudnn", None (picked)

    @nn.compact
    def __call__(self, x, mask=None, deterministic: bool = True):
        stream = ("batch", "length", "embed")  # split on length around the norms under sequence parallelism
        if self.dtype is not None:
            x = x.astype(self.dtype)
        x = constrain(x, stream)
        common = dict(recipe=self.recipe, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_init=self.kernel_init, norm=self.norm, epsilon=self.epsilon)
        a = MultiHeadAttention(self.num_heads, num_kv_heads=self.num_kv_heads, rotary=self.rotary,
                               causal=self.causal, implementation=self.attention_implementation, name="attn",
                               **common)(x, mask)
        x = constrain(x + nn.Dropout(self.dropout_rate)(a, deterministic=deterministic), stream)
        if self.moe is None:
            m = LayerNormMLP(self.d_ff, activation=self.activation, use_bias=False, name="mlp", **common)(x)
        else:
            cfg = self.moe if isinstance(self.moe, MoEConfig) else MoEConfig(**dict(self.moe))
            m = MoE(cfg.num_experts, cfg.top_k, cfg.d_ff or self.d_ff, activation=self.activation, name="moe",
                    dispatch=cfg.dispatch, **common)(x)
        return constrain(x + nn.Dropout(self.dropout_rate)(m, deterministic=deterministic), stream)
