"""The GPT of the main job: byte embedding, jaxhq TransformerLayers, final RMSNorm and a jaxhq Dense LM head.

Every GEMM (attention, MLP and the LM head) goes through the recipe, so the head has roles too
("lm_head"); the embedding table stays in float32 (a gather, see `embed`). Presets: `tiny` trains on a
2-core CPU in a minute or two, `small` and `medium` are for a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
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
        x = embed(emb, tokens, dtype)
        layer_cls = remat_layer(TransformerLayer, c.remat)
        for i in range(c.num_layers):
            x = layer_cls(num_heads=c.num_heads, d_ff=c.d_ff, recipe=self.recipe, num_kv_heads=c.num_kv_heads,
                          activation=c.activation, norm=c.norm, dtype=dtype, name=f"layers_{i}")(x, None,
                                                                                                 deterministic)
        x = make_norm(c.norm, dtype=dtype, name="final_norm")(x)
        logits = Dense(c.vocab_size, self.recipe, use_bias=False, kernel_axes=("embed", "vocab"), dtype=dtype,
                       name="lm_head")(x)
        return logits.astype(jnp.float32)


def embed(table, tokens, dtype=None):
    """Row lookup `table[tokens]` in `dtype` (default: the table's), exact: a gather (out-of-range tokens give
    zero rows). Its gradient is `one_hot(tokens).T @ g`, a GEMM in g's dtype with float32 accumulation (the
    products are exact), deterministic on a GPU, where the scatter-add that a gather's own gradient becomes is
    not. (A one-hot matmul forward, in float32 at the highest precision, cost an H100 0.5 ms per step at 8192
    tokens and d 4096.)"""
    return _embed(table, tokens, (table.shape[0], jnp.dtype(table.dtype).name, jnp.dtype(dtype or table.dtype).name))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embed(table, tokens, spec):
    return jnp.take(table, tokens, axis=0, mode="fill", fill_value=0).astype(spec[2])


def _embed_fwd(table, tokens, spec):
    return _embed(table, tokens, spec), tokens


def _embed_bwd(spec, tokens, g):
    vocab, table_dtype, _ = spec
    one_hot = jax.nn.one_hot(tokens, vocab, dtype=g.dtype)
    grad = jnp.einsum("...v,...d->vd", one_hot, g, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
    return grad.astype(table_dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


def example_tokens(config: GPTConfig, batch_size: int = 2):
    return jnp.zeros((batch_size, config.seq_len), jnp.int32)
