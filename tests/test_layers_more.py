"""jaxhq.layers, part 2: MoE, attention numerics, per-layer factories in the residuals, delayed-scaling state
over steps, and shape errors that name the layer."""
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxhq
from jaxhq import ops, recipes
from jaxhq.formats import NVFP4, Float8CurrentScaling, Identity, QuantizationError, quantize
from jaxhq.layers import Dense, DotProductAttention, MoE, TransformerLayer, merge_quant_state
from test_ffi_checks import spy_launches  # noqa: E402
from test_layers import KEY, Wrap, fixed_quant_key, rand, unbox  # noqa: F401  (shared helpers, fixture)


def _compare_jit(layer, hand, p, x):
    a = jax.jit(jax.value_and_grad(layer, argnums=(0, 1)))(p, x)
    b = jax.jit(jax.value_and_grad(hand, argnums=(0, 1)))(p, x)
    jax.tree.map(lambda u, w: np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=1e-6, atol=1e-6), a, b)


def test_moe_matches_hand_built_ops(fixed_quant_key):
    rec = recipes.get("fp8_current")
    x = rand(0, (2, 8, 32))
    mod = Wrap(lambda: MoE(3, 2, 16, rec, activation="silu", name="moe"))
    v = unbox(jax.jit(mod.init)(jax.random.key(1), x))
    p = v["params"]["moe"]

    def layer(p, x):
        return jnp.sum(jnp.sin(mod.apply({"params": {"moe": p}}, x)))

    def hand(p, x):
        x2 = x.reshape(-1, 32)
        probs = jax.nn.softmax(x2 @ p["router"], axis=-1)
        w, idx = jax.lax.top_k(probs, 2)
        w = w / w.sum(-1, keepdims=True)
        order = jnp.argsort(idx.reshape(-1), stable=True)
        tok = jnp.repeat(jnp.arange(x2.shape[0]), 2)[order]
        sizes = jnp.bincount(idx.reshape(-1), length=3)
        qs1 = [rec.dense_quantizers(f"moe.experts_{g}.fc1", "grouped_linear") for g in range(3)]
        qs2 = [rec.dense_quantizers(f"moe.experts_{g}.fc2", "grouped_linear") for g in range(3)]
        h = jax.nn.silu(ops.grouped_dense(x2[tok], p["fc1"]["kernel"], sizes, quantizers=qs1, key=KEY))
        y = ops.grouped_dense(h, p["fc2"]["kernel"], sizes, quantizers=qs2, key=KEY)
        out = jnp.zeros_like(x2).at[tok].add(y * w.reshape(-1)[order][:, None])
        return jnp.sum(jnp.sin(out))

    _compare_jit(layer, hand, p, x)


@pytest.mark.parametrize("name", ["fp8_block", "mxfp8", "fp8_delayed"])
def test_grouped_dense_quantizes_the_float32_master_kernel_as_its_cast(name, monkeypatch):
    """GroupedDense in bf16 hands the op its float32 kernel (the quantize kernels round it as they read it,
    JAXHQ_KERNELS=all): output and input gradient equal the op on the kernel cast to bf16 first, bit for bit;
    the kernel's gradient comes back in float32 (the bf16 GEMM output, cast); the delayed-scaling state advances
    from the cast's amax, as before."""
    from jaxhq.layers import GroupedDense
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    rec = recipes.get(name)
    x, sizes = rand(5, (24, 32)).astype(jnp.bfloat16), jnp.asarray([8, 0, 16], jnp.int32)
    mod = GroupedDense(64, 3, rec, dtype=jnp.bfloat16, name="gd")
    v = unbox(jax.jit(lambda x: mod.init(jax.random.key(2), x, sizes))(x))
    kernel = v["params"]["kernel"]
    assert kernel.dtype == jnp.float32
    qss = [rec.dense_quantizers(mod.group_path(g), "grouped_linear") for g in range(3)]
    states = [v["quant_state"][f"experts_{g}"] for g in range(3)] if "quant_state" in v else None

    def layer(k, x):
        y, upd = mod.apply({**v, "params": {"kernel": k}}, x, sizes, mutable=["quant_state"])
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), upd

    def hand(k, x):
        y = ops.grouped_dense(x, k.astype(jnp.bfloat16), sizes, quantizers=qss, states=states)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    launches = spy_launches(monkeypatch)
    (la, upd), (dka, dxa) = jax.jit(jax.value_and_grad(layer, argnums=(0, 1), has_aux=True))(kernel, x)
    # the weights' launch reads the float32 kernels (one vmapped launch of all experts)
    assert ((32, 64), jnp.float32) in [(s[-2:], dt) for s, dt, _, _ in launches], launches
    lb, (dkb, dxb) = jax.jit(jax.value_and_grad(hand, argnums=(0, 1)))(kernel, x)
    assert dka.dtype == jnp.float32
    for a, b in ((la, lb), (dxa, dxb), (dka, dkb)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if states is not None:  # the weight's next amax history entry: the bf16 kernel's amax
        for g in range(3):
            got = upd["quant_state"][f"experts_{g}"]["weight"]["amax_history"]
            want = jnp.max(jnp.abs(kernel[g].astype(jnp.bfloat16))).astype(jnp.float32)
            assert float(got.reshape(-1)[0]) == float(want), (g, got)


def test_moe_bf16_matches_float64_per_token_experts():
    rec = recipes.bf16()
    x = rand(3, (10, 16))
    mod = MoE(3, 2, 8, rec, activation="gelu")
    p = unbox(jax.jit(mod.init)(jax.random.key(4), x))["params"]
    with jax.default_matmul_precision("highest"):  # no TF32 on GPU: the reference is float64
        y = np.asarray(jax.jit(mod.apply)({"params": p}, x), np.float64)
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    xn = np.asarray(x, np.float64)
    logits = xn @ P["router"]
    pr = np.exp(logits - logits.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    ref = np.zeros_like(xn)
    for t in range(10):
        top = np.argsort(-pr[t])[:2]
        wt = pr[t, top] / pr[t, top].sum()
        for e, we in zip(top, wt):
            u = xn[t] @ P["fc1"]["kernel"][e]
            h = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))  # jax.nn.gelu (tanh)
            ref[t] += we * (h @ P["fc2"]["kernel"][e])
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)


# ------------------------------------------------- attention numerics

def _np_attention(q, k, v, allowed):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, v)


def test_identity_attention_causal_padding_gqa_against_float64():
    q, k, v = rand(1, (2, 6, 4, 8)), rand(2, (2, 6, 2, 8)), rand(3, (2, 6, 2, 8))
    mask = jnp.arange(6)[None, :] < jnp.array([[6], [4]])
    allowed = np.tril(np.ones((6, 6), bool))[None, None] & np.asarray(mask)[:, None, None, :]
    dpa = DotProductAttention(recipes.bf16())
    with jax.default_matmul_precision("highest"):  # no TF32 on GPU: the reference is float64
        y = jax.jit(dpa.apply)({}, q, k, v, mask)
    np.testing.assert_allclose(np.asarray(y), _np_attention(q, k, v, allowed), rtol=1e-5, atol=1e-5)


def test_quantized_attention_forward_and_backward_points():
    """Fake quantization at qkv, s, o and at do, dp, dqkv, against a reference with explicit backward math."""
    q8 = Float8CurrentScaling("e4m3")
    g8 = Float8CurrentScaling("e5m2")
    rec = jaxhq.CustomRecipe(lambda r: (q8 if r.tensor_type in ("qkv", "s", "o") else g8)
                             if r.module_type == "dpa" else Identity(), name="dpa8")
    q, k, v = rand(1, (2, 4, 4, 8)), rand(2, (2, 4, 2, 8)), rand(3, (2, 4, 2, 8))
    ct = rand(4, (2, 4, 4, 8))
    dpa = DotProductAttention(rec)
    y, grads = jax.jit(lambda q, k, v, ct: (lambda r: (r[0], r[1](ct)))(jax.vjp(lambda *a: dpa.apply({}, *a), q, k, v)))(q, k, v, ct)

    @jax.jit
    def reference(q, k, v, ct):
        fq = lambda a, z: quantize(a, z, ("rowwise",)).dequantize()
        qq, kq, vq = fq(q, q8), jnp.repeat(fq(k, q8), 2, axis=2), jnp.repeat(fq(v, q8), 2, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", qq, kq, precision="highest") / np.sqrt(8)
        s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        pq = fq(p, q8)
        o = fq(jnp.einsum("bnts,bsnh->btnh", pq, vq, precision="highest"), q8)
        do = fq(ct, g8)
        dv = jnp.einsum("bnts,btnh->bsnh", pq, do, precision="highest")
        dp = fq(jnp.einsum("btnh,bsnh->bnts", do, vq, precision="highest"), g8)
        ds = p * (dp - jnp.sum(dp * p, -1, keepdims=True)) / np.sqrt(8)
        dq = jnp.einsum("bnts,bsnh->btnh", ds, kq, precision="highest")
        dk = jnp.einsum("bnts,btnh->bsnh", ds, qq, precision="highest")
        fold = lambda a: a.reshape(2, 4, 2, 2, 8).sum(3)
        ref = (fq(dq, g8), fq(fold(dk), g8), fq(fold(dv), g8))
        return o, ref

    o, ref = reference(q, k, v, ct)
    np.testing.assert_allclose(np.asarray(y), np.asarray(o), rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=2e-2 * float(jnp.abs(b).max()))


def test_high_precision_attention_picks_its_implementation():
    from jaxhq.layers.attention import fused_implementation
    q = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
    want = "cudnn" if jax.default_backend() == "gpu" else "xla"
    assert fused_implementation(q, q) == want
    assert fused_implementation(q.astype(jnp.float32), q.astype(jnp.float32)) == "xla"  # cuDNN: bf16/fp16 only
    assert fused_implementation(jnp.ones((1, 8, 4, 12), jnp.bfloat16), q) == "xla"  # head dim not a multiple of 8
    assert fused_implementation(q, q, "xla") == "xla" and fused_implementation(q, q, "cudnn") == "cudnn"
    with pytest.raises(ValueError, match="'xla', 'cudnn' or None, got 'flash'"):
        fused_implementation(q, q, "flash")


@pytest.mark.gpu
def test_attention_on_gpu_runs_cudnn_and_matches_xla():
    """bf16 MultiHeadAttention on a GPU: the picked implementation is cuDNN's fused kernel (a cuDNN custom call
    in the compiled HLO) and its output and gradients match XLA's attention. The two round intermediates
    (probabilities, partial sums) to bf16 at different points, and bf16 keeps 8 significant bits, so an
    element may differ by a few units of 2^-8 relative; a relative Frobenius bound of 2e-2 allows that, while
    a wrong mask, scale or head layout gives differences of order 1."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    x = rand(40, (2, 256, 256)).astype(jnp.bfloat16)
    mods = {impl: jaxhq.layers.MultiHeadAttention(4, recipes.bf16(), dtype=jnp.bfloat16, implementation=impl)
            for impl in (None, "xla")}
    p = unbox(jax.jit(mods["xla"].init)(jax.random.key(1), x))

    def fn(m):
        return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(m.apply(p, x).astype(jnp.float32))),
                                          (0, 1)))
    hlo = fn(mods[None]).lower(p, x).compile().as_text()
    assert "cudnn" in hlo.lower(), "expected cuDNN's fused attention in the compiled step"
    got, want = fn(mods[None])(p, x), fn(mods["xla"])(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b) + 1e-6


# ------------------------------------------------- a per-layer factory lands

def test_per_layer_factory_lands_in_residuals(monkeypatch):
    seen = []
    dense_mod = importlib.import_module("jaxhq.ops.dense")
    orig = dense_mod._forward

    def spy(x, kernel, bias, states, key, kernel_amax, qs, *args, **kw):  # the copies handed to the residuals
        out = orig(x, kernel, bias, states, key, kernel_amax, qs, *args, **kw)
        for slot, qt in (("input", out[2]), ("weight", out[3])):
            seen.append((qs.role(slot), qt.columnwise.format if qt.columnwise is not None else None))
        return out

    monkeypatch.setattr(dense_mod, "_forward", spy)
    dpa_calls = []
    monkeypatch.setattr(jaxhq.layers.attention, "quantized_attention",
                        lambda *a, **k: dpa_calls.append(1))
    rec = jaxhq.CustomRecipe(recipes.first_last_factory(3, edge="mxfp8", middle="nvfp4"), name="edges")

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = TransformerLayer(2, 32, rec, name=f"layers_{i}")(x)
            return x

    x = rand(0, (1, 16, 16))
    m = Stack()
    p = jax.eval_shape(lambda: m.init({"params": jax.random.key(0), "quant": KEY}, x))
    seen.clear()
    jax.eval_shape(jax.grad(lambda p: jnp.sum(m.apply(p, x, rngs={"quant": KEY}))), p)
    saved = {(r.name, r.tensor_type): f for r, f in seen if r.tensor_type in ("input", "weight") and f}
    assert len(saved) == 3 * 4 * 2
    for (name, tt), f in saved.items():
        want = {"input": "mxfp8_e4m3", "weight": "mxfp8_e4m3"} if name.startswith(("layers_0", "layers_2")) \
            else {"input": "nvfp4_rht", "weight": "nvfp4_2d"}
        assert f == want[tt], (name, tt, f)
    assert not dpa_calls  # attention Identity -> plain jax.nn.dot_product_attention


# ------------------------------------------------- delayed scaling over steps

def test_delayed_scaling_history_and_scales_over_five_steps():
    hist_len, margin = 3, 1
    rec = recipes.fp8_delayed(history_len=hist_len, margin=margin)
    mod = Wrap(lambda: Dense(16, rec, use_bias=False, name="fc"))
    xs = [rand(10 + i, (8, 32), scale=1.0 + i) for i in range(5)]
    cs = [rand(20 + i, (8, 16), scale=0.1 * (i + 1)) for i in range(5)]
    v = unbox(jax.jit(mod.init)(jax.random.key(0), xs[0]))
    params, qs = v["params"], v["quant_state"]
    assert set(qs["fc"]) == {"input", "weight", "grad_output"}

    @jax.jit
    def step(params, qs, x, c):
        def loss(params, qs):
            y, mut = mod.apply({"params": params, "quant_state": qs}, x, mutable=["quant_state"])
            return jnp.sum(y * c), mut["quant_state"]
        (_, fwd), (_, gqs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, qs)
        return merge_quant_state(fwd, gqs)

    expect = {k: np.zeros(hist_len) for k in ("input", "weight", "grad_output")}
    e4m3_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # E4M3 everywhere (the recipe's default)
    fmax = {"input": e4m3_max, "weight": e4m3_max, "grad_output": e4m3_max}
    w = np.asarray(params["fc"]["kernel"])
    for x, c in zip(xs, cs):
        qs = step(params, qs, x, c)
        for slot, amax in (("input", np.abs(x).max()), ("weight", np.abs(w).max()), ("grad_output", np.abs(c).max())):
            expect[slot] = np.roll(expect[slot], 1)
            expect[slot][0] = amax
            st = qs["fc"][slot]
            np.testing.assert_allclose(np.asarray(st["amax_history"]), expect[slot], rtol=1e-6)
            np.testing.assert_allclose(float(st["scale"]), fmax[slot] / expect[slot].max() / 2 ** margin, rtol=1e-6)


# ------------------------------------------------- errors name the layer

def test_feature_size_the_format_cannot_take_names_the_layer():
    rec = jaxhq.CustomRecipe(lambda r: NVFP4(rht=True) if r.tensor_type == "weight" else Identity(), name="w-rht")

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Dense(24, rec, name="head")(Dense(32, rec, name="body")(x))

    with pytest.raises(QuantizationError, match=r"layer 'head'.*weight.*\[32, 24\].*multiple of 16"):
        jax.eval_shape(lambda: M().init(jax.random.key(0), jnp.zeros((16, 8))))


def test_token_count_error_names_the_role():
    rec = recipes.nvfp4()
    m = Dense(32, rec)
    x = jnp.zeros((10, 32))
    p = jax.eval_shape(lambda: m.init(jax.random.key(0), x))
    with pytest.raises(QuantizationError, match=r"input of linear/input@dense.*multiple of 16"):
        jax.eval_shape(jax.grad(lambda p: jnp.sum(m.apply(p, x, rngs={"quant": KEY}))), p)


def test_rotary_matches_float64_rotation_and_its_transpose():
    """rotary against the rotate-half formula in float64, and its gradient against the transposed rotation."""
    x, g = rand(0, (2, 6, 3, 8)), rand(1, (2, 6, 3, 8))
    pos = np.arange(6, dtype=np.float64)[:, None]
    ang = pos * 10000.0 ** (-np.arange(4, dtype=np.float64) / 4)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = np.split(np.asarray(x, np.float64), 2, -1)
    g1, g2 = np.split(np.asarray(g, np.float64), 2, -1)
    y, vjp = jax.vjp(jaxhq.layers.rotary, x)
    # float32 angles and products: |error| ~ 1e-6 of |x| (positions < 6 keep the angles' rounding small)
    np.testing.assert_allclose(np.asarray(y), np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1),
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(vjp(g)[0]), np.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], -1),
                               rtol=0, atol=1e-5)
