"""The MLP activation's input gradient quantized in one launch from h and dy (jaxhq.ops.activation).

The kernels compute the gradient as csrc/activation.h says; `_oracle` below is the CPU's statement of it again in
numpy float32 (fmaf emulated exactly), written independently of the C++: on the CPU handlers the launch must equal
the plain quantize of the oracle's gradient bit for bit, and jaxhq_act_grad the oracle. On the GPU (approximate
exp and reciprocal) the launch must equal the plain quantize of the GPU's jaxhq_act_grad bit for bit, and that
stays within one bfloat16 ulp of the CPU's. The oracle itself is checked against
float64 derivatives and against JAX's autodiff of jax.nn's functions (the unfused path), with tolerances argued
at each check. GPU tests are marked `gpu`.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxhq.ffi as jffi
from jaxhq.ffi import primitives as P
from jaxhq.ops import activation as A

F = np.float32
ACTS = list(A.ACTIVATIONS)
_seed = itertools.count(7100)


# -- the oracle: csrc/activation.h in numpy float32 -------------------------------------------------------------
def fma32(a, b, c):
    """float32 fma, correctly rounded: a * b is exact in float64; the float64 sum's error (TwoSum) decides the
    one case where rounding that sum to float32 differs from rounding the exact value (a float32 midpoint)."""
    a, b, c = (np.asarray(v, F) for v in (a, b, c))
    p, c64 = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F)
    r64 = r.astype(np.float64)
    with np.errstate(invalid="ignore"):
        other = np.nextafter(r, np.where(s > r64, F(np.inf), F(-np.inf)).astype(F))
        halfway = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2) & (err != 0)
        toward_other = (err > 0) == (other.astype(np.float64) > r64)
    return np.where(halfway & toward_other, other, r).astype(F)


def exp_act(x):
    x = np.asarray(x, F)
    with np.errstate(over="ignore", invalid="ignore"):
        n = np.rint(x * F(1.44269504))
        r = fma32(n, F(-0.693359375), x)
        r = fma32(n, F(2.12194440e-4), r)
        p = np.full_like(x, F(1.98412698e-4))
        for c in (1.38888889e-3, 8.33333333e-3, 4.16666667e-2, 1.66666667e-1, 0.5, 1.0, 1.0):
            p = fma32(p, r, F(c))
        ni = np.clip(np.nan_to_num(n), -150, 128).astype(np.int64)
        n1 = np.sign(ni) * (np.abs(ni) // 2)  # C's division: toward zero
        n2 = ni - n1
        two = lambda k: ((k + 127).astype(np.uint32) << 23).view(F)  # noqa: E731
        out = (p * two(n1)) * two(n2)
    out = np.where(x > F(88.72284), F(np.inf), out)
    out = np.where(x < F(-103.97208), F(0), out)
    return np.where(np.isnan(x), x, out).astype(F)


def _sigmoid(x):
    return F(1) / (F(1) + exp_act(-x))


def _gelu_parts(x):
    z = F(0.797884561) * fma32(F(0.044715) * x, x * x, x)
    th = F(1) - F(2) * (F(1) / (F(1) + exp_act(z + z)))
    return F(0.5) * (F(1) + th), th


def _value(kind, x):
    if kind == P.ACT_GELU:
        return x * _gelu_parts(x)[0]
    if kind == P.ACT_SILU:
        return x * _sigmoid(x)
    return np.where(np.isnan(x), x, np.where(x > 0, x, F(0))).astype(F)


def _slope(kind, x):
    if kind == P.ACT_GELU:
        cdf, th = _gelu_parts(x)
        dz = F(0.797884561) * fma32(F(0.134145) * x, x, F(1))
        return fma32((F(0.5) * x) * fma32(-th, th, F(1)), dz, cdf)
    if kind == P.ACT_SILU:
        s = _sigmoid(x)
        return s * fma32(x, F(1) - s, F(1))
    return np.where(x > 0, F(1), F(0)).astype(F)


def _oracle(h, dy, act):
    """The input gradient of activation id `act` (float32, before its rounding) from h and dy (float32)."""
    kind, gated = act & ~P.GATED, bool(act & P.GATED)
    with np.errstate(all="ignore"):
        if not gated:
            return dy * _slope(kind, h)
        f = h.shape[-1] // 2
        g, u = h[..., :f], h[..., f:]
        return np.concatenate([(dy * u) * _slope(kind, g), dy * _value(kind, g)], axis=-1)


def _f64_grad(h, dy, activation):
    """The exact derivative in float64 (jax.nn.gelu is the tanh form)."""
    h, dy = h.astype(np.float64), dy.astype(np.float64)
    gated = A.is_gated(activation)
    name = {"swiglu": "silu", "geglu": "gelu"}.get(activation, activation)
    x = h[..., :h.shape[-1] // 2] if gated else h
    if name == "silu":
        s = 1 / (1 + np.exp(-x))
        val, slope = x * s, s * (1 + x * (1 - s))
    elif name == "gelu":
        c = np.sqrt(2 / np.pi)
        th = np.tanh(c * (x + 0.044715 * x ** 3))
        val = 0.5 * x * (1 + th)
        slope = 0.5 * (1 + th) + 0.5 * x * (1 - th ** 2) * c * (1 + 3 * 0.044715 * x ** 2)
    else:
        val, slope = np.maximum(x, 0), (x > 0).astype(np.float64)
    if not gated:
        return dy * slope
    u = h[..., h.shape[-1] // 2:]
    return np.concatenate([dy * u * slope, dy * val], axis=-1)


def _size(h, dy, activation):
    """The size of the terms of the gradient's formula: |dy| (1 + |u|) (1 + |x|) (gated, gate half), |dy| (1 + |x|)."""
    hs, ds = np.abs(_f32(h)), np.abs(_f32(dy))
    if not A.is_gated(activation):
        return ds * (1 + hs)
    f = hs.shape[-1] // 2
    return np.concatenate([ds * (hs[:, f:] + 1) * (1 + hs[:, :f]), ds * (1 + hs[:, :f])], axis=-1)


def _inputs(key, rows, width, activation, scale=3.0):
    kh, kd = jax.random.split(key)
    h = (scale * jax.random.normal(kh, (rows, width), jnp.float32)).astype(jnp.bfloat16)
    dw = width // 2 if A.is_gated(activation) else width
    dy = jax.random.normal(kd, (rows, dw), jnp.float32).astype(jnp.bfloat16)
    return h, dy


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _bf16(a32):
    return jnp.asarray(np.asarray(a32, F).astype(ml_dtypes.bfloat16))


# -- the oracle against references no one here wrote -----------------------------------------------------------
def test_exp_act_within_two_ulps_of_float64():
    x = np.concatenate([np.linspace(-104, 89, 200001, dtype=F), F([0.0, -0.0, 1e-30, -1e-30, 88.7, -87.3])])
    got = exp_act(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    normal = (want > 1.2e-38) & (want < 3.4e38)
    ulp = np.spacing(want[normal].astype(F)).astype(np.float64)
    assert np.max(np.abs(got[normal] - want[normal]) / ulp) <= 2.0  # a degree-7 polynomial, 9 roundings
    sub = want <= 1.2e-38  # subnormal results: one rounding of the last product (absolute error <= 1 ulp there)
    assert np.max(np.abs(got[sub] - want[sub])) <= 2 * 1.4e-45
    assert np.isinf(exp_act(F([89.0, np.inf]))).all() and (exp_act(F([-104.0, -np.inf])) == 0).all()
    assert np.isnan(exp_act(F([np.nan]))).all()


@pytest.mark.parametrize("activation", ACTS)
def test_oracle_matches_float64_derivative(activation):
    h, dy = _inputs(jax.random.key(next(_seed)), 64, 256, activation)
    got = _oracle(_f32(h), _f32(dy), A.kernel_id(activation)).astype(np.float64)
    want = _f64_grad(_f32(h), _f32(dy), activation)
    # float32 arithmetic on terms of _size: a few float32 ulps of it, far below the bfloat16 rounding that follows
    assert np.all(np.abs(got - want) <= 1e-6 * _size(h, dy, activation) + 1e-30)


@pytest.mark.parametrize("activation", ACTS)
def test_oracle_rounds_like_jax_autodiff(activation):
    """The kernels' gradient is the true one rounded once to bfloat16 (within half an ulp, 2^-8 relative, plus
    the float32 error above). The unfused path, JAX differentiating jax.nn's activation in bfloat16, rounds its
    intermediate terms to bfloat16 (measured: up to 1.9 * 2^-8 of the terms' size, more than the result's own
    rounding where terms cancel, as gelu's slope does near x = -0.75); the bound is 2^-6 of the terms' size."""
    h, dy = _inputs(jax.random.key(next(_seed)), 64, 256, activation)
    auto = _f32(A.input_grad(h, dy, activation).grad())
    ours = _f32(_bf16(_oracle(_f32(h), _f32(dy), A.kernel_id(activation))))
    true = _f64_grad(_f32(h), _f32(dy), activation)
    size = _size(h, dy, activation)
    assert np.all(np.abs(ours - true) <= 2.0 ** -8 * np.abs(true) + 1e-6 * size + 1e-30)
    assert np.all(np.abs(auto - true) <= 2.0 ** -6 * size)


# -- the launch against the plain quantize of the oracle's gradient ----------------------------------------------
# (row, col) format pairs: what the GPU kernel takes (one format both sides), and on the CPU any pair
GPU_PAIRS = [((P.MXFP8, 0), (P.MXFP8, 0)), ((P.MXFP8, P.OPT_DECODED), (P.MXFP8, P.OPT_DECODED)),
             ((P.FP8_BLOCK_1x128, 0), (P.FP8_BLOCK_1x128, 0)), ((P.FP8_BLOCK_128x128, 0), (P.FP8_BLOCK_128x128, 0)),
             ((P.FP8_TENSOR, P.OPT_E5M2), (P.FP8_TENSOR, P.OPT_E5M2))]
CPU_ONLY_PAIRS = [((P.NVFP4, 0), (P.NVFP4, P.OPT_RHT | P.OPT_SR)), ((P.MXFP8, 0), (P.NONE, 0))]


def _act_grad(h, dy, act, device):
    h, dy = jax.device_put((h, dy), device)
    return jax.block_until_ready(jax.jit(lambda h, dy: P.act_grad(h, dy, act))(h, dy))


def _launch(h, dy, row, col, act, poison, device=None):
    m, k = h.shape
    seed = P.seed_words(jnp.array([7, 9], jnp.uint32), m, k)
    scales = jnp.array([0.75, 2.0], jnp.float32)
    if device is not None:
        h, dy, seed, scales = jax.device_put((h, dy, seed, scales), device)
    fn = jax.jit(lambda h, dy, sc, sd: P.quantize(h, (sc[0], sc[1]), sd, row, col, poison=poison,
                                                  want_amax=True, dy=None if act == 0 else dy, act=act))
    return jax.block_until_ready(fn(h, dy, scales, seed))


def _same(got, want):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert np.array_equal(np.atleast_1d(np.asarray(g)).view(np.uint8), np.atleast_1d(np.asarray(w)).view(np.uint8))


needs_cpu_kernels = pytest.mark.skipif(not jffi.available("cpu"), reason="jaxhq FFI extension not built")


@needs_cpu_kernels
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("pair", GPU_PAIRS + CPU_ONLY_PAIRS, ids=str)
def test_cpu_launch_equals_quantize_of_the_oracle(activation, pair):
    rows, width = (48, 160) if pair[0][0] != P.FP8_BLOCK_128x128 else (136, 288)
    h, dy = _inputs(jax.random.key(next(_seed)), rows, width, activation)
    act = A.kernel_id(activation)
    cpu = jax.devices("cpu")[0]
    got = _launch(h, dy, *pair, act, poison=True, device=cpu)
    dh = _bf16(_oracle(_f32(h), _f32(dy), act))
    want = _launch(dh, dy, *pair, 0, poison=True, device=cpu)
    _same(got, want)


@needs_cpu_kernels
@pytest.mark.parametrize("activation", ACTS)
def test_cpu_act_grad_equals_the_oracle(activation):
    """jaxhq_act_grad on the CPU: the oracle rounded to bfloat16, bit for bit (odd widths, rows of one)."""
    for rows, width in ((40, 96), (1, 38), (7, 22)):
        h, dy = _inputs(jax.random.key(next(_seed)), rows, width, activation)
        act = A.kernel_id(activation)
        got = _act_grad(h, dy, act, jax.devices("cpu")[0])
        want = _bf16(_oracle(_f32(h), _f32(dy), act))
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@needs_cpu_kernels
def test_launch_refuses_bad_inputs():
    h, dy = _inputs(jax.random.key(1), 16, 64, "swiglu")
    pair = GPU_PAIRS[0]
    with pytest.raises(Exception, match="activation gradient takes h and dy"):
        _launch(h, dy[:, :16], *pair, A.kernel_id("swiglu"), poison=False, device=jax.devices("cpu")[0])
    with pytest.raises(Exception, match="unknown activation id"):
        _launch(h, dy, *pair, 7, poison=False, device=jax.devices("cpu")[0])


# -- the dense op: fused where the kernels take it, the same gradients as the unfused composition ---------------
def _dense_grads(recipe_q, activation, x, w, fused_env, monkeypatch):
    from jaxhq.recipes import DenseQuantizers
    qs = DenseQuantizers(input=recipe_q, weight=recipe_q, grad_output=recipe_q)
    monkeypatch.setenv("JAXHQ_KERNELS", "all" if fused_env else "gpu")

    def loss_fused(x, w):
        from jaxhq import ops
        return jnp.sum(ops.dense(x, w, None, quantizers=qs, activation=activation).astype(jnp.float32) ** 2)

    def loss_unfused(x, w):
        from jaxhq import ops
        return jnp.sum(A.activate(ops.dense(x, w, None, quantizers=qs), activation).astype(jnp.float32) ** 2)

    fn = jax.jit(jax.value_and_grad(loss_fused if fused_env else loss_unfused, argnums=(0, 1)))
    hlo = fn.lower(x, w).as_text()
    return fn(x, w), hlo


@needs_cpu_kernels
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_dense_activation_fuses_and_matches_unfused(activation, monkeypatch):
    from jaxhq.formats import MXFP8
    kx, kw = jax.random.split(jax.random.key(next(_seed)))
    x = jax.random.normal(kx, (64, 96), jnp.float32).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(kw, (96, 128), jnp.float32)
    (lf, gf), hlo = _dense_grads(MXFP8(), activation, x, w, True, monkeypatch)
    (lu, gu), _ = _dense_grads(MXFP8(), activation, x, w, False, monkeypatch)
    act = A.kernel_id(activation)
    assert f"act = {act} : i32" in hlo  # the gradient's copies came from h and dy in one launch
    # The same forward. The GEMM output's gradients differ within 2^-6 of their terms' size (the kernel's exact
    # float32 against JAX's bfloat16 differentiation), which moves a few of their MXFP8 codes by a step or two (2^-3
    # relative; about 5% of codes, test_act_grad_path_switch); through the GEMMs' sums the weight and input
    # gradients then differ by a few percent of their norm (measured at most 1.7% over 16 draws): bound 5%.
    assert np.allclose(float(lf), float(lu), rtol=1e-6)
    for a, b in zip(gf, gu):
        a, b = _f32(a), _f32(b)
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b)


@needs_cpu_kernels
def test_act_grad_path_switch(monkeypatch):
    """JAXHQ_QUANTIZE_PATH act_grad=xla (MXFP8's default outside JAXHQ_KERNELS=all) computes the gradient first:
    no launch takes h and dy. The two gradients differ within 2^-6 of the terms' size (the CPU handler's exact
    float32 against XLA differentiating jax.nn.silu in bfloat16, test_oracle_rounds_like_jax_autodiff), so their
    MXFP8 copies differ by that plus at most two E4M3 steps where it moves a code or its block's scale (2^-3
    relative each)."""
    from jaxhq.formats import MXFP8, quantize
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    h, dy = _inputs(jax.random.key(next(_seed)), 32, 64, "swiglu")
    run = jax.jit(lambda h, dy: quantize(A.input_grad(h, dy, "swiglu"), MXFP8()))
    assert f"act = {A.kernel_id('swiglu')} : i32" in run.lower(h, dy).as_text()
    fused = run(h, dy)
    monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", "act_grad=xla")
    run = jax.jit(lambda h, dy: quantize(A.input_grad(h, dy, "swiglu"), MXFP8()))
    assert f"act = {A.kernel_id('swiglu')} : i32" not in run.lower(h, dy).as_text()
    plain = run(h, dy)
    a, b = _f32(fused.dequantize("rowwise")), _f32(plain.dequantize("rowwise"))
    assert np.all(np.abs(a - b) <= 0.25 * np.maximum(np.abs(a), np.abs(b)) + 2.0 ** -6 * _size(h, dy, "swiglu"))
    assert np.mean(a != b) < 0.25  # mostly the same codes


@needs_cpu_kernels
def test_act_grad_path_per_family(monkeypatch):
    """The default takes the launch for the FP8 families' gradients of ACT_GRAD_MIN_ELEMENTS elements and more
    and computes MXFP8's gradient in XLA; a Hybrid takes it only where both sides' families do. Smaller gradients
    are computed by XLA unless the launch is asked for outright (act_grad=kernel)."""
    from jaxhq.formats import MXFP8, Float8Block, Float8DelayedScaling, Hybrid, quantize
    from jaxhq.formats.quantize import ACT_GRAD_MIN_ELEMENTS, DEFAULT_PATHS, act_grad_path
    monkeypatch.delenv("JAXHQ_QUANTIZE_PATH", raising=False)
    monkeypatch.setenv("JAXHQ_KERNELS", "gpu")
    both, large = ("rowwise", "columnwise"), ACT_GRAD_MIN_ELEMENTS
    families = (Float8Block(), Float8DelayedScaling(), MXFP8(), Hybrid(Float8Block(), MXFP8()))
    assert [act_grad_path(q, both, large) for q in families] == ["kernel", "kernel", "xla", "xla"]
    assert act_grad_path(Hybrid(Float8Block(), MXFP8()), ("rowwise",), large) == "kernel"
    assert act_grad_path(Float8Block(), both, large - 1) == "xla"
    monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", "act_grad=kernel")
    assert act_grad_path(Float8Block(), both, 1) == "kernel"
    monkeypatch.setenv("JAXHQ_KERNELS", "all")  # the CPU handlers take the launch, under the default's choice
    monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", f"act_grad={DEFAULT_PATHS['act_grad']}")
    rows = ACT_GRAD_MIN_ELEMENTS // 256  # traced only: no kernel runs
    big, big_dy = (jax.ShapeDtypeStruct((rows, w), jnp.bfloat16) for w in (256, 128))
    small, small_dy = (jax.ShapeDtypeStruct((rows - 1, w), jnp.bfloat16) for w in (256, 128))
    act = f"act = {A.kernel_id('swiglu')} : i32"
    run = jax.jit(lambda h, dy: quantize(A.input_grad(h, dy, "swiglu"), Float8Block()))
    assert act not in run.lower(small, small_dy).as_text()
    for q, launch in ((Float8Block(), True), (MXFP8(), False), (Hybrid(Float8Block(), MXFP8()), False)):
        run = jax.jit(lambda h, dy, q=q: quantize(A.input_grad(h, dy, "swiglu"), q))
        assert (act in run.lower(big, big_dy).as_text()) == launch, q
    monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", "act_grad=fp8_block+mxfp9")
    with pytest.raises(ValueError, match="act_grad also takes families"):
        act_grad_path(MXFP8(), both)


def test_amax_formats_fall_back_to_the_gradient(monkeypatch):
    """Current scaling reads a per-tensor amax before quantizing: the launch cannot take h and dy, and the
    gradient itself is quantized, exactly as quantize(grad) does."""
    from jaxhq.formats import Float8CurrentScaling, quantize
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    h, dy = _inputs(jax.random.key(next(_seed)), 32, 64, "swiglu")
    g = A.input_grad(h, dy, "swiglu")
    q = Float8CurrentScaling()
    got = jax.jit(lambda: quantize(g, q))()
    want = jax.jit(lambda: quantize(g.grad(), q))()
    for a in ("rowwise", "columnwise"):
        assert np.array_equal(np.asarray(got.get(a).data).view(np.uint8), np.asarray(want.get(a).data).view(np.uint8))


def test_dense_activation_refuses_odd_gated_width():
    from jaxhq import ops
    from jaxhq.formats import MXFP8
    from jaxhq.recipes import DenseQuantizers
    qs = DenseQuantizers(input=MXFP8(), weight=MXFP8(), grad_output=MXFP8())
    x, w = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32, 66), jnp.float32)
    assert ops.dense(x, w, quantizers=qs, activation="swiglu").shape == (4, 33)
    with pytest.raises(ValueError, match=r"halves the 65 outputs of kernel of shape \(32, 65\)"):
        ops.dense(x, w[:, :65], quantizers=qs, activation="swiglu")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.dense(x, w, quantizers=qs, activation="swish")


def test_gpu_takes_one_fp8_format_on_both_sides():
    from jaxhq.ffi.dispatch import act_grad_on_gpu
    assert act_grad_on_gpu({"rowwise": (P.MXFP8, 0), "columnwise": (P.MXFP8, P.OPT_DECODED)})
    assert act_grad_on_gpu({"rowwise": (P.FP8_TENSOR, 0), "columnwise": (P.FP8_TENSOR, 0)})
    assert not act_grad_on_gpu({"rowwise": (P.MXFP8, 0)})
    assert not act_grad_on_gpu({"rowwise": (P.MXFP8, 0), "columnwise": (P.FP8_BLOCK_1x128, 0)})
    assert not act_grad_on_gpu({"rowwise": (P.NVFP4, 0), "columnwise": (P.NVFP4, 0)})


def test_which_quantizers_take_the_launch():
    """takes_act_grad (what jaxhq.plan shows): no side may need a per-tensor amax first; the GPU takes one format
    on both sides, the CPU any pair."""
    from jaxhq.ffi.dispatch import takes_act_grad
    from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Float8DelayedScaling, Hybrid
    for q in (Float8Block(), Float8DelayedScaling(), MXFP8()):
        assert takes_act_grad(q, platform="cuda") and takes_act_grad(q, platform="cpu"), q
    for q in (Float8CurrentScaling(), NVFP4(), Hybrid(MXFP8(), NVFP4())):
        assert not takes_act_grad(q, platform="cpu"), q
    mixed = Hybrid(MXFP8(), Float8Block())
    assert takes_act_grad(mixed, platform="cpu") and not takes_act_grad(mixed, platform="cuda")


# -- GPU: the kernel against the CPU handler, bit for bit -----------------------------------------------------
def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# aligned tiles (gated FP8 formats: a gate and its up tile per CTA); partial row tiles of those; partial column
# tiles (gated halves not whole tiles); gated halves that are not a multiple of 8 (no vector loads)
GPU_SHAPES = [(256, 512), (300, 512), (300, 400), (130, 200)]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="no GPU")
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("pair", GPU_PAIRS, ids=str)
def test_gpu_launch_equals_quantize_of_act_grad(activation, pair):
    """The launch equals the unfused composition on the GPU: jaxhq_act_grad, then the plain quantize (the
    formats' scales are computed as the GPU computes them, so the CPU handler is not the reference here)."""
    shape = GPU_SHAPES[(ACTS.index(activation) + GPU_PAIRS.index(pair)) % len(GPU_SHAPES)]
    h, dy = _inputs(jax.random.key(next(_seed)), *shape, activation)
    act = A.kernel_id(activation)
    gpu = _gpus()[0]
    got = _launch(h, dy, *pair, act, poison=True, device=gpu)
    want = _launch(_act_grad(h, dy, act, gpu), dy, *pair, 0, poison=True, device=gpu)
    _same(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="no GPU")
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_act_grad_within_one_ulp_of_cpu(activation):
    """ex2.approx and rcp.approx (a few float32 ulps of the formula's terms) against the CPU's exact float32: the
    bfloat16 results are one rounding apart at most (2^-7 relative: two halves of an ulp), or within that float32
    error of the terms' size where the gradient is near zero and its sign may flip."""
    for rows, width in GPU_SHAPES + [(3, 38)]:
        h, dy = _inputs(jax.random.key(next(_seed)), rows, width, activation)
        act = A.kernel_id(activation)
        got = _f32(_act_grad(h, dy, act, _gpus()[0]))
        want = _f32(_act_grad(h, dy, act, jax.devices("cpu")[0]))
        bound = 2.0 ** -7 * np.maximum(np.abs(got), np.abs(want)) + 1e-5 * _size(h, dy, activation)
        assert np.all(np.abs(got - want) <= bound)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="no GPU")
def test_gpu_refuses_nvfp4_activation_gradient():
    h, dy = _inputs(jax.random.key(3), 64, 128, "swiglu")
    with pytest.raises(Exception, match="activation gradient's copies are made on the GPU"):
        _launch(h, dy, (P.NVFP4, 0), (P.NVFP4, 0), A.kernel_id("swiglu"), poison=False, device=_gpus()[0])
