"""DotProductAttention with quantizer roles, and MultiHeadAttention that wires its boundaries.

DPA slots (module_type "dpa"): forward qkv (Q, K, V), s (softmax probabilities), o (output); backward do (the
output's gradient), dp (gradient of the probabilities), dqkv (gradients of Q, K, V). With every active slot
Identity the module is plain `jax.nn.dot_product_attention` (causal and padding masks, GQA), run by cuDNN's
fused flash attention on a GPU for bf16/fp16 inputs it takes (see `fused_implementation`). Otherwise it is an
einsum softmax attention that fake-quantizes (quantize then dequantize, rowwise copy: blocks along the last
axis) each forward tensor, and each backward tensor through `grad_quantize`, an identity whose backward
fake-quantizes the cotangent. Boundary slots wired by a parent (`output_role`, `grad_input_role`) carry the
consumer's role and are quantized by that consumer, not here: MultiHeadAttention wires `o` to proj's input and
`dqkv` to the qkv layer's grad_output (and proj's grad-input boundary to `do`), so each role is used once.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..formats import Identity, QTensor, fake_quantize, normalize, quantize, side
from ..formats.base import ROWWISE
from ..recipes import CustomRecipe
from ..roles import DPA_TENSOR_TYPES, QuantizerRole, Slot, dpa_slots, gemm_roles
from . import introspect
from .common import child_path, module_path, quant_key
from .dense import Dense, LayerNormDense, default_kernel_init


def _fq(x, q, key):
    """Forward fake quantization (straight-through gradient); None or plain Identity is a no-op."""
    return x if q is None else fake_quantize(x, q, ROWWISE, key=key).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def grad_quantize(x, q, key):
    """Identity in the forward; the backward returns the cotangent quantized-dequantized by `q`."""
    return x


def _gq_fwd(x, q, key):
    return x, key


def _gq_bwd(q, key, g):
    qt: QTensor = quantize(g, q, (ROWWISE,), key=key)
    return qt.dequantize(ROWWISE).astype(g.dtype), None


grad_quantize.defvjp(_gq_fwd, _gq_bwd)


def _gq(x, q, key):
    return x if q is None else grad_quantize(x, q, key)


def active(q) -> bool:
    """A quantizer that changes values (not None and not an Identity without a cast)."""
    if q is None:
        return False
    r = side(normalize(q), ROWWISE)
    return not (isinstance(r, Identity) and r.dtype is None)


def normalize_mask(mask):
    """Boolean mask (True = attend) broadcastable to [B, N, T, S]: [B, S] key padding, [B, T, S] or 4D."""
    if mask is None:
        return None
    mask = jnp.asarray(mask, bool)
    if mask.ndim == 2:
        return mask[:, None, None, :]
    if mask.ndim == 3:
        return mask[:, None, :, :]
    if mask.ndim != 4:
        raise ValueError(f"attention mask must be [B, S], [B, T, S] or [B, N, T, S], got shape {mask.shape}")
    return mask


def quantized_attention(q, k, v, mask, *, causal: bool, scale: Optional[float], quantizers: dict, key=None):
    """Softmax attention (BTNH layout, GQA when K heads divide N) with fake quantization at the dpa slots:
    quantizers {tensor_type: Quantizer | None}."""
    qz = {t: (quantizers.get(t) if active(quantizers.get(t)) else None) for t in DPA_TENSOR_TYPES}
    keys = {t: None if key is None else jax.random.fold_in(key, i) for i, t in enumerate(DPA_TENSOR_TYPES)}
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    q, k, v = (_fq(_gq(a, qz["dqkv"], keys["dqkv"]), qz["qkv"], keys["qkv"]) for a in (q, k, v))
    logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, kh, g, h), k,
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    allowed = jnp.ones((t, s), bool)
    if causal:
        allowed = jnp.tril(allowed)
    allowed = jnp.broadcast_to(allowed, (b, n, t, s))
    if mask is not None:
        allowed = allowed & jnp.broadcast_to(normalize_mask(mask), (b, n, t, s))
    allowed = allowed.reshape(b, n // g, g, t, s)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(logits, axis=-1)
    p = _gq(_fq(p, qz["s"], keys["s"]), qz["dp"], keys["dp"]).astype(v.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)
    return _gq(_fq(o, qz["o"], keys["o"]), qz["do"], keys["do"])


FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fused_implementation(q, k, implementation: Optional[str] = None) -> str:
    """The `jax.nn.dot_product_attention` implementation for high-precision attention: `implementation` when
    given ("xla" or "cudnn"), else "cudnn" on a GPU for bf16/fp16 q and k with a head dim that is a multiple
    of 8 and at most 128 (cuDNN's flash attention: no [B, N, T, S] logits in memory), else "xla"."""
    if implementation is not None:
        if implementation not in ("xla", "cudnn"):
            raise ValueError(f"attention implementation must be 'xla', 'cudnn' or None, got {implementation!r}")
        return implementation
    from ..ops.gemm import platform
    h = q.shape[-1]
    ok = (platform() == "gpu" and jnp.dtype(q.dtype) in FUSED_DTYPES and k.dtype == q.dtype and h % 8 == 0
          and h <= 128)
    return "cudnn" if ok else "xla"


def plain_attention(q, k, v, mask, *, causal: bool, scale: Optional[float], implementation: Optional[str] = None):
    """`jax.nn.dot_product_attention` with the implementation `fused_implementation` picks; where cuDNN turns
    the call down at trace time (a shape, mask or version it does not take) and none was asked for, XLA's."""
    impl = fused_implementation(q, k, implementation)
    call = functools.partial(jax.nn.dot_product_attention, q, k, v, mask=normalize_mask(mask), is_causal=causal,
                             scale=scale)
    if impl == "cudnn" and implementation is None:
        try:
            return call(implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            return call(implementation="xla")
    return call(implementation=impl)


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale + mask) v for q [B, T, N, H], k and v [B, S, K, H] (K divides N: GQA)."""

    recipe: CustomRecipe
    causal: bool = True
    scale: Optional[float] = None
    output_role: Optional[QuantizerRole] = None  # consumer of o (it quantizes o); None: this module does
    grad_input_role: Optional[QuantizerRole] = None  # consumer of dqkv; None: this module quantizes it
    implementation: Optional[str] = None  # high-precision attention: "xla", "cudnn", or None (picked)

    @nn.compact
    def __call__(self, q, k, v, mask=None):
        path = module_path(self, "dpa")
        if q.ndim != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
            raise ValueError(f"DotProductAttention {path!r}: q {q.shape}, k {k.shape}, v {v.shape}: expected "
                             "[B, T, N, H] and [B, S, K, H] with K dividing N")
        wired = {"o": self.output_role, "dqkv": self.grad_input_role}
        slots = tuple(Slot(s.key, s.direction, wired[s.key]) if wired.get(s.key) is not None else s
                      for s in dpa_slots(path))
        introspect.record(path, slots)
        quantizers = {}
        for s in slots:
            if s.role is None or s.role.module_type != "dpa":
                continue  # a boundary the consumer quantizes
            qz = self.recipe.quantizer(s.role)
            if qz.stateful:
                raise ValueError(f"DotProductAttention {path!r}: {s.role} got {qz.label}; delayed scaling is not "
                                 "supported in attention, use a current-scaling quantizer or Identity()")
            quantizers[s.key] = qz
        with jax.named_scope("attention"):  # profiles (benchmarks/step_profile.py) attribute these ops to it
            if not any(active(qz) for qz in quantizers.values()):
                return plain_attention(q, k, v, mask, causal=self.causal, scale=self.scale,
                                       implementation=self.implementation)
            return quantized_attention(q, k, v, mask, causal=self.causal, scale=self.scale,
                                       quantizers=quantizers, key=quant_key(self))


def rotary(x, base: float = 10000.0, positions=None):
    """Rotary position embedding (rotate-half) on [B, T, N, H] with even H, computed in float32."""
    t, h = x.shape[1], x.shape[-1]
    if h % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {h}")
    pos = jnp.arange(t, dtype=jnp.float32) if positions is None else jnp.asarray(positions, jnp.float32)
    freq = base ** (-jnp.arange(h // 2, dtype=jnp.float32) / (h // 2))
    ang = pos[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class MultiHeadAttention(nn.Module):
    """Self-attention: fused qkv Dense (LayerNormDense when `norm` is set) -> rotary -> DPA -> proj Dense."""

    num_heads: int
    recipe: CustomRecipe
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rotary: bool = True
    rotary_base: float = 10000.0
    causal: bool = True
    norm: Optional[str] = None
    epsilon: float = 1e-6
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    output_role: Optional[QuantizerRole] = None
    grad_input_role: Optional[QuantizerRole] = None
    implementation: Optional[str] = None  # of the high-precision attention, see DotProductAttention

    @nn.compact
    def __call__(self, x, mask=None):
        n = self.num_heads
        kv = self.num_kv_heads or n
        d = x.shape[-1]
        h = self.head_dim or d // n
        if n % kv:
            raise ValueError(f"MultiHeadAttention {module_path(self, 'attn')!r}: num_kv_heads={kv} must divide "
                             f"num_heads={n}")
        qkv_roles, proj_roles = gemm_roles(child_path(self, "qkv")), gemm_roles(child_path(self, "proj"))
        dpa_path = child_path(self, "dpa")
        common = dict(recipe=self.recipe, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                      kernel_init=self.kernel_init, kernel_axes=("embed", "heads"),
                      output_role=QuantizerRole("dpa", "qkv", dpa_path), grad_input_role=self.grad_input_role)
        if self.norm:
            y = LayerNormDense((n + 2 * kv) * h, norm=self.norm, epsilon=self.epsilon, name="qkv", **common)(x)
        else:
            y = Dense((n + 2 * kv) * h, name="qkv", **common)(x)
        lead = y.shape[:-1]
        q = y[..., :n * h].reshape(*lead, n, h)
        k = y[..., n * h:(n + kv) * h].reshape(*lead, kv, h)
        v = y[..., (n + kv) * h:].reshape(*lead, kv, h)
        if self.rotary:
            q, k = rotary(q, self.rotary_base), rotary(k, self.rotary_base)
        o = DotProductAttention(self.recipe, causal=self.causal, output_role=proj_roles["input"],
                                grad_input_role=qkv_roles["grad_output"], implementation=self.implementation,
                                name="dpa")(q, k, v, mask)
        o = o.reshape(*lead, n * h)
        return Dense(d, self.recipe, use_bias=self.use_bias, kernel_axes=("heads", "embed"), dtype=self.dtype,
                     param_dtype=self.param_dtype, kernel_init=self.kernel_init, output_role=self.output_role,
                     grad_input_role=QuantizerRole("dpa", "do", dpa_path), name="proj")(o)
