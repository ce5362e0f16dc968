"""The GPT of the main job: byte embedding, jaxhq TransformerLayers, final RMSNorm and a jaxhq Dense LM head.

Every GEMM (attention, MLP and the LM head) goes through the recipe, so the head has roles too
("lm_head"); the embedding lookup stays in float32. Presets: `tiny` trains on a
2-core CPU in a minute or two, `small` and `medium` are for a GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..recipes import CustomRecipe
from .data import VOCAB_SIZE


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder-only transformer; `dtype` is the activation dtype (params stay float32)."""

    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 384
    num_kv_heads: Optional[int] = None
    seq_len: int = 128
    vocab_size: int = VOCAB_SIZE
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    dtype: str = "float32"
    remat: str = "none"  # "none" | "full" | "quantized" | "offload" (see remat.py)

    def replace(self, **kw) -> "GPTConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        d, f, kv = self.d_model, self.d_ff, self.num_kv_heads or self.num_heads
        head = d // self.num_heads
        attn = d * (self.num_heads + 2 * kv) * head + self.num_heads * head * d
        mlp = d * f * (2 if self.activation in ("swiglu", "geglu") else 1) + f * d
        return 2 * self.vocab_size * d + self.num_layers * (attn + mlp)


PRESETS = {
    "micro": GPTConfig(num_layers=1, d_model=32, num_heads=2, d_ff=64, seq_len=32),
    "tiny": GPTConfig(num_layers=2, d_model=128, num_heads=4, d_ff=384, seq_len=128),
    "small": GPTConfig(num_layers=6, d_model=512, num_heads=8, d_ff=1536, seq_len=512, dtype="bfloat16"),
    "medium": GPTConfig(num_layers=12, d_model=1024, num_heads=16, d_ff=3072, seq_len=1024, dtype="bfloat16"),
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


class GPT(nn.Module):
    """Decoder-only transformer over bytes: `GPT(config, recipe)(tokens[B, T]) -> logits[B, T, vocab]` (fp32)."""

    config: GPTConfig
    recipe: CustomRecipe

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        from ..layers import Dense, TransformerLayer
        from ..layers.common import make_norm
        from .remat import remat_layer
        c = self.config
        dtype = jnp.dtype(c.dtype)
        emb = self.param("embedding", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
                         (c.vocab_size, c.d_model), jnp.float32)
        x = embed(emb, tokens).astype(dtype)
        layer_cls = remat_layer(TransformerLayer, c.remat)
        for i in range(c.num_layers):
            x = layer_cls(num_heads=c.num_heads, d_ff=c.d_ff, recipe=self.recipe, num_kv_heads=c.num_kv_heads,
                          activation=c.activation, norm=c.norm, dtype=dtype, name=f"layers_{i}")(x, None,
                                                                                                 deterministic)
        x = make_norm(c.norm, dtype=dtype, name="final_norm")(x)
        logits = Dense(c.vocab_size, self.recipe, use_bias=False, kernel_axes=("embed", "vocab"), dtype=dtype,
                       name="lm_head")(x)
        return logits.astype(jnp.float32)


def embed(table, tokens):
    """Row lookup written as one_hot(tokens) @ table (exact at HIGHEST precision): its gradient is a matmul,
    deterministic on a GPU, where the scatter-add that a gather's gradient becomes is not."""
    one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
    return jnp.einsum("btv,vd->btd", one_hot, table, precision=jax.lax.Precision.HIGHEST)


def example_tokens(config: GPTConfig, batch_size: int = 2):
    return jnp.zeros((batch_size, config.seq_len), jnp.int32)
