"""quantize_model: a transformer written with plain flax.linen, its Dense/DenseGeneral/Einsum calls run under a
recipe with the original params, against the same model built from jaxhq layers; roles from module paths."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhq
from jaxhq import recipes
from jaxhq.layers import Dense, DenseGeneral, model_roles, quantize_model

V, D, H, F, T = 64, 32, 4, 64, 16


class Block(nn.Module):
    """Pre-norm attention + MLP; `dense`/`general` build the GEMM modules (plain Flax or jaxhq)."""
    dense: object
    general: object

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln1")(x)
        q = self.general((H, D // H), name="q")(h)
        k = self.general((H, D // H), name="k")(h)
        v = self.general((H, D // H), name="v")(h)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)
        x = x + self.dense(D, name="out")(o)
        h = nn.LayerNorm(name="ln2")(x)
        return x + self.dense(D, name="fc2")(jax.nn.gelu(self.dense(F, name="fc1")(h)))


class LM(nn.Module):
    dense: object
    general: object
    head: object

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        for i in range(2):
            x = Block(self.dense, self.general, name=f"layers_{i}")(x)
        return self.head("head")(nn.LayerNorm(name="ln_f")(x))


def plain_lm():
    return LM(nn.Dense, nn.DenseGeneral, lambda name: nn.Einsum((D, V), "btd,dv->btv", use_bias=False, name=name))


def jaxhq_lm(rec):
    dense = lambda f, name: Dense(f, rec, name=name)
    general = lambda f, name: DenseGeneral(f, rec, name=name)
    return LM(dense, general, lambda name: Dense(V, rec, use_bias=False, name=name))


def loss_fn(model, params, tokens):
    logits = model.apply(params, tokens, rngs={"quant": jax.random.key(5)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])


@pytest.mark.parametrize("name", ["mxfp8", "fp8_current"])
def test_same_loss_and_grads_as_jaxhq_model(name):
    rec = recipes.get(name)
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, V)
    plain = plain_lm()
    params = jax.jit(plain.init)(jax.random.key(1), tokens)
    qm = quantize_model(plain, rec)
    mine = jaxhq_lm(rec)
    assert jax.tree.structure(nn.meta.unbox(jax.eval_shape(mine.init, jax.random.key(1), tokens))) == \
        jax.tree.structure(params)
    la, ga = jax.jit(jax.value_and_grad(lambda p: loss_fn(qm, p, tokens)))(params)
    lb, gb = jax.jit(jax.value_and_grad(lambda p: loss_fn(mine, p, tokens)))(params)
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
    jax.tree.map(lambda u, w: np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=1e-5, atol=1e-6),
                 ga, gb)
    # quantization really happened: the plain model's loss differs
    lp = jax.jit(lambda p: loss_fn(plain, p, tokens))(params)
    assert abs(float(lp) - float(la)) > 1e-6


def test_bf16_is_the_original_model_and_every_gemm_has_roles():
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, V)
    plain = plain_lm()
    params = jax.jit(plain.init)(jax.random.key(1), tokens)
    qm = quantize_model(plain, "bf16")
    a = jax.jit(lambda p: qm.apply(p, tokens))(params)
    b = jax.jit(lambda p: plain.apply(p, tokens))(params)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    roles = model_roles(quantize_model(plain, "mxfp8"), recipes.mxfp8(), tokens)
    gemms = [f"layers_{i}.{m}" for i in range(2) for m in ("q", "k", "v", "out", "fc1", "fc2")] + ["head"]
    assert {r.name for r in roles} == set(gemms)
    assert len(roles) == 3 * len(gemms)
    plan = jaxhq.plan(recipes.mxfp8(), quantize_model(plain, "mxfp8"), tokens)
    assert "layers_1.fc2" in str(plan) and "embed" not in str(plan)


def test_delayed_scaling_state_through_quantize_model():
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, V)
    qm = quantize_model(plain_lm(), recipes.fp8_delayed(history_len=4))
    v = jax.jit(qm.init)(jax.random.key(1), tokens)
    assert set(v["quant_state"]["layers_0"]["fc1"]) == {"input", "weight", "grad_output"}
    _, mut = jax.jit(lambda v: qm.apply(v, tokens, mutable=["quant_state"]))(v)
    h = mut["quant_state"]["layers_0"]["fc1"]["weight"]["amax_history"]
    w = v["params"]["layers_0"]["fc1"]["kernel"]
    np.testing.assert_allclose(float(h[0]), float(jnp.abs(w).max()), rtol=1e-6)


def test_feature_size_error_names_the_module():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(24, name="odd")(nn.Dense(32, name="ok")(x))

    rec = jaxhq.CustomRecipe(lambda r: jaxhq.NVFP4(rht=True) if r.tensor_type == "weight" else jaxhq.Identity())
    with pytest.raises(jaxhq.formats.QuantizationError, match=r"layer 'odd'"):
        jax.eval_shape(lambda: quantize_model(M(), rec).init(jax.random.key(0), jnp.zeros((16, 8))))
