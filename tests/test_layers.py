"""jaxhq.layers, part 1: roles per module, equality with hand-built ops under every named recipe, and bit
identity with plain Flax layers under bf16()."""
import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhq
from jaxhq import ops, recipes
from jaxhq.layers import (Dense, DenseGeneral, LayerNormDense, LayerNormMLP, MoEConfig, MultiHeadAttention,
                          TransformerLayer, model_roles)
from jaxhq.layers import dense as layers_dense
from jaxhq.layers import moe as layers_moe

NAMED = ["bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"]
KEY = jax.random.key(42)


@pytest.fixture
def fixed_quant_key(monkeypatch):
    """Layers draw stochastic-rounding keys from the "quant" stream; pin them so a hand-built op can match."""
    monkeypatch.setattr(layers_dense, "quant_key", lambda m: KEY)
    monkeypatch.setattr(layers_moe, "quant_key", lambda m: KEY)


def rand(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def unbox(v):
    return nn.meta.unbox(v)


class Wrap(nn.Module):
    """Gives a layer a path ("blk.<name>") so role names are checked as full paths."""
    make: object

    @nn.compact
    def __call__(self, x):
        return self.make()(x)


def counts(roles):
    return collections.Counter((r.module_type, r.tensor_type) for r in roles)


# ---------------------------------------------------------------- roles

def test_roles_dense_mlp_attention_transformer():
    rec = recipes.mxfp8()
    x = jnp.zeros((2, 16, 32))
    roles = model_roles(Wrap(lambda: LayerNormMLP(64, rec, activation="swiglu", name="mlp")), rec, x)
    assert counts(roles) == {("linear", t): 2 for t in ("input", "weight", "grad_output")}
    assert {r.name for r in roles} == {"mlp.fc1", "mlp.fc2"}

    roles = model_roles(Wrap(lambda: MultiHeadAttention(4, rec, num_kv_heads=2, name="attn")), rec, x)
    c = counts(roles)
    assert c == {**{("linear", t): 2 for t in ("input", "weight", "grad_output")},
                 **{("dpa", t): 1 for t in ("qkv", "s", "do", "dp")}}  # o and dqkv are proj/qkv roles
    assert {r.name for r in roles} == {"attn.qkv", "attn.proj", "attn.dpa"}

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = TransformerLayer(4, 64, rec, num_kv_heads=2, name="layers_0")(x)
            return TransformerLayer(4, 64, rec, moe=MoEConfig(3, 2, 16), name="layers_1")(x)

    roles = model_roles(Stack(), rec, x)
    c = counts(roles)
    assert c[("linear", "input")] == 4 + 2 and c[("grouped_linear", "weight")] == 6 and c[("dpa", "s")] == 2
    assert {r.name for r in roles if r.module_type == "grouped_linear"} == {
        f"layers_1.moe.experts_{g}.{f}" for g in range(3) for f in ("fc1", "fc2")}
    assert "layers_0.mlp.fc2" in {r.name for r in roles}
    assert len(roles) == len(set(roles))


# ------------------------------------------------- equality with hand-built ops (forward and grads)

def _states(rec, name):
    qs = rec.dense_quantizers(name)
    st = {s: jaxhq.formats.init_state(getattr(qs, s)) for s in ("input", "weight", "grad_output")}
    return {k: v for k, v in st.items() if v is not None} or None


def _compare_jit(layer, hand, p, x, exact=True):
    a = jax.jit(jax.value_and_grad(layer, argnums=(0, 1)))(p, x)
    b = jax.jit(jax.value_and_grad(hand, argnums=(0, 1)))(p, x)
    check = (lambda u, w: np.testing.assert_array_equal(u, w)) if exact else \
        (lambda u, w: np.testing.assert_allclose(u, w, rtol=1e-6, atol=1e-6))
    jax.tree.map(lambda u, w: check(np.asarray(u), np.asarray(w)), a, b)


@pytest.mark.parametrize("name", NAMED)
def test_layernorm_dense_matches_hand_built_ops(name, fixed_quant_key):
    rec = recipes.get(name)
    x = rand(0, (2, 16, 32))
    mod = Wrap(lambda: LayerNormDense(32, rec, norm="layernorm", name="proj"))
    v = unbox(jax.jit(mod.init)(jax.random.key(1), x))
    p = v["params"]["proj"]

    def layer(p, x):
        return jnp.sum(jnp.sin(mod.apply({**v, "params": {"proj": p}}, x)))

    def hand(p, x):
        h = nn.LayerNorm(epsilon=1e-6).apply({"params": p["norm"]}, x)
        y = ops.dense(h, p["kernel"], p["bias"], quantizers=rec.dense_quantizers("proj"),
                      states=_states(rec, "proj"), key=KEY)
        return jnp.sum(jnp.sin(y))

    _compare_jit(layer, hand, p, x)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed"])
def test_mlp_matches_hand_built_ops(name, fixed_quant_key):
    rec = recipes.get(name)
    x = rand(0, (2, 16, 32))
    mod = Wrap(lambda: LayerNormMLP(48, rec, activation="gelu", name="mlp"))
    v = unbox(jax.jit(mod.init)(jax.random.key(1), x))
    p = v["params"]["mlp"]

    def layer(p, x):
        return jnp.sum(jnp.sin(mod.apply({**v, "params": {"mlp": p}}, x)))

    def hand(p, x):
        h = nn.LayerNorm(epsilon=1e-6).apply({"params": p["norm"]}, x)
        h = ops.dense(h, p["fc1"]["kernel"], p["fc1"]["bias"], quantizers=rec.dense_quantizers("mlp.fc1"),
                      states=_states(rec, "mlp.fc1"), key=KEY)
        h = jax.nn.gelu(h)
        y = ops.dense(h, p["fc2"]["kernel"], p["fc2"]["bias"], quantizers=rec.dense_quantizers("mlp.fc2"),
                      states=_states(rec, "mlp.fc2"), key=KEY)
        return jnp.sum(jnp.sin(y))

    _compare_jit(layer, hand, p, x)


# ------------------------------------------------- bf16 recipe == plain Flax, bit for bit

def _vg(f):
    """jit of (y, grads for a fixed cotangent): bit-identity holds for compiled code (eager op-by-op may differ);
    f's sin(.) is dropped, the cotangent carries the nonlinearity."""
    def run(p, x):
        y, vjp = jax.vjp(lambda p, x: f(p, x, True), p, x)
        return y, vjp(jnp.cos(y * 3.0))
    return jax.jit(run)


def _close_to_flax(a, b):
    """jaxhq's bf16 layers against plain Flax: the same math, but two XLA graphs whose float32 reductions (dots
    of at most a few hundred terms, norm statistics) may associate differently on another CPU, so equality holds
    up to reassociation: |a - b| <= n eps sum|terms| bounds it; with n <= 256 and eps = 2^-24 that is < 2e-5 of
    the largest magnitude (seen: 4.8e-7 absolute on values of order 1)."""
    def check(u, w):
        u, w = np.asarray(u, np.float64), np.asarray(w, np.float64)
        np.testing.assert_allclose(u, w, rtol=0, atol=2e-5 * max(np.abs(w).max(), 1e-30))
    jax.tree.map(check, a, b)


def test_bf16_dense_and_layernorm_dense_equal_flax():
    x = rand(0, (4, 8, 24))
    for mine, plain in ((Dense(40, recipes.bf16()), nn.Dense(40)),
                        (DenseGeneral((4, 10), recipes.bf16(), axis=(-2, -1)),
                         nn.DenseGeneral((4, 10), axis=(-2, -1)))):
        p = unbox(jax.jit(mine.init)(jax.random.key(1), x))
        _close_to_flax(_vg(lambda p, x, _: mine.apply(p, x))(p, x),
              _vg(lambda p, x, _: plain.apply(p, x))(p, x))

    mine = LayerNormDense(40, recipes.bf16(), norm="rmsnorm")
    p = unbox(jax.jit(mine.init)(jax.random.key(1), x))["params"]

    def plain(p, x):
        h = nn.RMSNorm(epsilon=1e-6).apply({"params": p["norm"]}, x)
        return nn.Dense(40).apply({"params": {"kernel": p["kernel"], "bias": p["bias"]}}, h)

    _close_to_flax(_vg(lambda p, x, _: mine.apply({"params": p}, x))(p, x),
          _vg(lambda p, x, _: plain(p, x))(p, x))


def test_bf16_mlp_and_attention_equal_flax():
    x = rand(0, (2, 8, 32))
    mlp = LayerNormMLP(48, recipes.bf16(), activation="swiglu", norm="layernorm")
    p = unbox(jax.jit(mlp.init)(jax.random.key(1), x))["params"]

    def plain_mlp(p, x):
        h = nn.LayerNorm(epsilon=1e-6).apply({"params": p["norm"]}, x)
        a, b = jnp.split(nn.Dense(96).apply({"params": p["fc1"]}, h), 2, -1)
        return nn.Dense(32).apply({"params": p["fc2"]}, jax.nn.silu(a) * b)

    _close_to_flax(_vg(lambda p, x, _: mlp.apply({"params": p}, x))(p, x),
          _vg(lambda p, x, _: plain_mlp(p, x))(p, x))

    mha = MultiHeadAttention(4, recipes.bf16(), num_kv_heads=2)
    p = unbox(jax.jit(mha.init)(jax.random.key(1), x))["params"]
    mask = jnp.arange(8)[None, :] < jnp.array([[8], [5]])  # key padding

    def plain_mha(p, x):
        y = nn.Dense(64, use_bias=False).apply({"params": p["qkv"]}, x)
        q, k, v = y[..., :32].reshape(2, 8, 4, 8), y[..., 32:48].reshape(2, 8, 2, 8), y[..., 48:].reshape(2, 8, 2, 8)
        q, k = jaxhq.layers.rotary(q), jaxhq.layers.rotary(k)
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None, None, :], is_causal=True)
        return nn.Dense(32, use_bias=False).apply({"params": p["proj"]}, o.reshape(2, 8, 32))

    _close_to_flax(_vg(lambda p, x, _: mha.apply({"params": p}, x, mask))(p, x),
          _vg(lambda p, x, _: plain_mha(p, x))(p, x))


