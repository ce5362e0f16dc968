"""Formats: casts against ml_dtypes, MXFP8 against JAX's MX quantize, NVFP4 against float64 numpy, round trips,
padding, special values, Hybrid, and the pytree under jit/vmap/grad/checkpoint."""
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhq.formats import (COLUMNWISE, MXFP8, NVFP4, ROWWISE, Float8Block, Float8CurrentScaling,
                           Float8DelayedScaling, Hybrid, Identity, QTensor, QuantizationError, fake_quantize,
                           init_state, quantize, update_state)
from jaxhq.formats import casts
from jaxhq.formats.nvfp4 import apply_rht

FORMATS = [Float8CurrentScaling("e4m3"), Float8CurrentScaling("e5m2"), Float8CurrentScaling(power_2_scale=True),
           MXFP8("e4m3"), MXFP8("e5m2"), NVFP4(), NVFP4(block_2d=True), NVFP4(rht=True),
           Float8Block((1, 128)), Float8Block((128, 128)), Identity(), Identity(jnp.bfloat16)]
# Relative Frobenius round-trip bound on N(0,1) data: half an ulp of the element format, with margin.
BOUND = {"fp8_e4m3": 0.035, "fp8_e5m2": 0.07, "fp8_e4m3_p2": 0.035, "mxfp8_e4m3": 0.035, "mxfp8_e5m2": 0.07,
         "nvfp4": 0.12, "nvfp4_2d": 0.14, "nvfp4_rht": 0.12, "fp8_block_1x128": 0.035,
         "fp8_block_128x128": 0.035, "identity": 0.0, "identity_bfloat16": 0.004}
SHAPES = [(64, 128), (3, 17, 45)]


def rand(key, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale).astype(dtype)


def bits(a):
    """Raw bytes of an array (NaN-safe exact comparison)."""
    return np.asarray(a).reshape(-1).view(np.uint8)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def qfor(q, x):
    """The copies a quantizer can make for x (RHT needs the transformed axis to be a multiple of 16)."""
    rows = int(np.prod(x.shape[:-1]))
    if isinstance(q, NVFP4) and q.rht and rows % 16:
        return (ROWWISE,)
    return (ROWWISE, COLUMNWISE)


# ---------------------------------------------------------------- casts against ml_dtypes

@pytest.mark.parametrize("fmt,mlt", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)])
def test_fp8_cast_matches_ml_dtypes(fmt, mlt):
    x = np.asarray(rand(1, (4096,), scale=200.0))
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-12, 1e6, -1e6, casts.FP8_MAX[fmt]])])
    ours = np.asarray(casts.saturating_fp8(jnp.asarray(x), fmt)).view(np.uint8)
    m = casts.FP8_MAX[fmt]
    ref = np.clip(x, -m, m).astype(mlt).view(np.uint8)
    np.testing.assert_array_equal(ours, ref)


def test_e2m1_codes_match_ml_dtypes():
    grid = np.float32(casts.E2M1_VALUES)
    mids = (grid[:-1] + grid[1:]) / 2  # the ties
    x = np.concatenate([np.asarray(rand(2, (8192,), scale=3.0)), grid, -grid, mids, -mids,
                        np.nextafter(mids, 0), np.nextafter(mids, 10)]).astype(np.float32)
    ours = np.asarray(casts.e2m1_codes(jnp.asarray(np.clip(x, -6, 6))))
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(np.asarray(casts.e2m1_decode(jnp.asarray(ours))),
                                  np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e8m0_round_up_is_the_next_power_of_two():
    q = np.abs(np.asarray(rand(3, (4096,), scale=1.0))) * np.float32(2.0) ** np.random.default_rng(0).integers(
        -100, 100, 4096).astype(np.float32)
    q = np.concatenate([q, np.float32([1.0, 0.5, 2.0 ** -100, 3.0, 2.0 ** 100])])
    e = np.asarray(casts.e8m0_round_up(jnp.asarray(q)))
    ref = np.ceil(np.log2(q.astype(np.float64)))  # float64 oracle: smallest 2**n >= q
    np.testing.assert_array_equal(e.astype(np.int64) - 127, ref.astype(np.int64))
    # and the byte means the same thing to ml_dtypes' E8M0
    dec = e.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(dec, 2.0 ** ref)


def test_nibble_packing_low_first():
    codes = jnp.asarray(np.random.default_rng(1).integers(0, 16, (5, 8)), jnp.uint8)
    packed = np.asarray(casts.pack_nibbles(codes))
    np.testing.assert_array_equal(packed & 0xF, np.asarray(codes)[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, np.asarray(codes)[:, 1::2])
    np.testing.assert_array_equal(np.asarray(casts.unpack_nibbles(jnp.asarray(packed))), np.asarray(codes))


# ---------------------------------------------------------------- MXFP8 against JAX's own MX quantize

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_matches_jax_mx_quantize(dtype, fmt):
    from jax._src.cudnn.scaled_matmul_stablehlo import BlockScaleConfig
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_mx_quantize

    dt = casts.fp8_dtype(fmt)
    x = rand(4, (96, 256), dtype) * jnp.exp(rand(5, (96, 1), jnp.float32) * 4).astype(dtype)  # varied block ranges
    cfg = BlockScaleConfig(mode="mxfp8", block_size=32, data_type=dt, scale_type=jnp.float8_e8m0fnu,
                           global_scale=None, infer_only=False)
    ref_data, ref_scale = jax_mx_quantize(x, cfg)
    s = quantize(x, MXFP8(fmt), ROWWISE).rowwise
    np.testing.assert_array_equal(np.asarray(s.data).view(np.uint8), np.asarray(ref_data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s.scale_inv).view(np.uint8), np.asarray(ref_scale).view(np.uint8))


def test_mxfp8_zero_block_gives_zeros_not_nan():
    x = rand(6, (4, 64)).at[1, :32].set(0.0)
    s = quantize(x, MXFP8(), ROWWISE).rowwise
    assert np.all(np.asarray(s.data[1, :32], np.float32) == 0)
    assert np.asarray(s.scale_inv).view(np.uint8)[1, 0] == 0
    assert np.all(np.isfinite(np.asarray(quantize(x, MXFP8()).dequantize())))


# ---------------------------------------------------------------- NVFP4 against float64 numpy

def nvfp4_numpy(x, block_2d=False):
    """The NVFP4 formulas in float64 numpy: returns (codes, decode scale as float64, dequantized, tie mask)."""
    x = np.asarray(x, np.float64)
    rows, cols = x.shape
    amax = np.abs(x).max()
    genc = 1.0 if amax == 0 else 448.0 * 6.0 / amax
    pr, pc = -(-rows // 16) * 16 if block_2d else rows, -(-cols // 16) * 16
    xp = np.zeros((pr, pc))
    xp[:rows, :cols] = x
    ab = np.abs(xp).reshape(pr, pc // 16, 16).max(-1)
    if block_2d:
        ab = np.repeat(ab.reshape(pr // 16, 16, pc // 16).max(1), 16, axis=0)
    dec = np.minimum(ab / 6.0 * genc, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    enc = np.where(dec == 0, 0.0, 1.0 / np.where(dec == 0, 1.0, dec / genc))
    y = np.clip(xp * np.repeat(enc, 16, axis=1), -6, 6)
    codes = y.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    mids = (np.float64(casts.E2M1_VALUES)[:-1] + np.float64(casts.E2M1_VALUES)[1:]) / 2
    near_tie = np.min(np.abs(np.abs(y)[..., None] - mids), axis=-1) < 1e-5 * np.maximum(np.abs(y), 1)
    deq = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.repeat(dec / genc, 16, axis=1))
    return codes[:rows, :cols], dec[:rows], deq[:rows, :cols], near_tie[:rows, :cols]


@pytest.mark.parametrize("shape", [(64, 128), (33, 70)])
@pytest.mark.parametrize("block_2d", [False, True])
def test_nvfp4_matches_float64_numpy(shape, block_2d):
    x = rand(7, shape) * jnp.exp(rand(8, (shape[0], 1)) * 2)
    s = quantize(x, NVFP4(block_2d=block_2d), ROWWISE).rowwise
    codes, dec, deq, near_tie = nvfp4_numpy(x, block_2d)
    ours = np.asarray(casts.unpack_nibbles(s.data))[:, :shape[1]]
    # float32 and float64 arithmetic can only disagree on a value that lands within rounding of a tie.
    assert np.array_equal(ours[~near_tie], codes[~near_tie])
    np.testing.assert_array_equal(np.asarray(s.scale_inv, np.float64), dec)
    np.testing.assert_allclose(np.asarray(s.dequantize(), np.float64)[~near_tie], deq[~near_tie], rtol=1e-6)


def test_nvfp4_rht_is_orthonormal_and_cancels():
    x = rand(9, (64, 48))
    t = apply_rht(x)
    np.testing.assert_allclose(np.asarray(apply_rht(t, inverse=True)), np.asarray(x), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(t)), np.linalg.norm(np.asarray(x)), rtol=1e-5)
    a, b = rand(10, (8, 32)), rand(11, (5, 32))
    np.testing.assert_allclose(np.asarray(apply_rht(a) @ apply_rht(b).T), np.asarray(a @ b.T), atol=1e-4)


def test_nvfp4_stochastic_rounding_unbiased_and_reproducible():
    q = NVFP4(stochastic_rounding=True)
    x = rand(12, (16, 64))
    k = jax.random.PRNGKey(0)
    a, b = quantize(x, q, ROWWISE, key=k), quantize(x, q, ROWWISE, key=k)
    np.testing.assert_array_equal(np.asarray(a.rowwise.data), np.asarray(b.rowwise.data))
    n = 400
    deqs = jax.vmap(lambda kk: quantize(x, q, ROWWISE, key=kk).dequantize())(jax.random.split(k, n))
    mean_err = np.asarray(deqs.mean(0) - x)
    # Per element, one draw's error is at most one grid step (<= 2 units of the block scale); the mean of n
    # draws has a standard deviation of at most step / (2 sqrt n): 5 sigma bounds it. Elements beyond +-6
    # units (the block max when the E4M3 decode scale rounded down) saturate, so they are biased by design.
    rne = quantize(x, NVFP4(), ROWWISE).rowwise
    unit = np.repeat(np.asarray(rne.scale_inv, np.float32) / np.asarray(casts.E2M1_MAX * 448 / rne.amax), 16, 1)
    inside = np.abs(np.asarray(x)) <= 6 * unit
    assert inside.mean() > 0.9
    assert np.all((np.abs(mean_err) <= 5 * 2 * unit / (2 * np.sqrt(n)) + 1e-7)[inside])
    with pytest.raises(ValueError, match="key"):
        quantize(x, q, ROWWISE)


# ---------------------------------------------------------------- round trips, shapes, special values

@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.label)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_round_trip_within_format_bound(q, shape, dtype):
    x = rand(13, shape, dtype)
    usage = qfor(q, x)
    qt = jax.jit(lambda v: quantize(v, q, usage))(x)
    for axis in usage:
        d = qt.dequantize(axis)
        assert d.shape == x.shape and d.dtype == x.dtype
        # fp16 output rounding adds ~2^-11; identity_bf16 of fp16 data is bounded by bf16 rounding.
        assert rel_err(d, x) <= BOUND[q.label] + 1e-3, (axis, rel_err(d, x))


@pytest.mark.parametrize("q", [MXFP8(), NVFP4(), Float8Block((1, 128)), Float8Block((128, 128)),
                               NVFP4(block_2d=True)], ids=lambda q: q.label)
def test_padding_inside_does_not_change_results(q):
    x = rand(14, (40, 70))
    xp = jnp.zeros((48, 256)).at[:40, :70].set(x)
    a, b = quantize(x, q, ROWWISE).rowwise, quantize(xp, q, ROWWISE).rowwise
    da, db = np.asarray(a.dequantize()), np.asarray(b.dequantize())
    np.testing.assert_array_equal(da, db[:40, :70])


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1e6, 1e30])
@pytest.mark.parametrize("q", [Float8CurrentScaling(), MXFP8(), NVFP4(), Float8Block()], ids=lambda q: q.label)
def test_huge_and_tiny_values(q, scale):
    x = rand(15, (32, 128), scale=scale)
    assert rel_err(quantize(x, q).dequantize(), x) <= BOUND[q.label]


@pytest.mark.parametrize("q", [Float8CurrentScaling(), NVFP4(), Float8Block((128, 128))], ids=lambda q: q.label)
def test_all_zero_tensor(q):
    qt = quantize(jnp.zeros((32, 128)), q)
    assert np.all(np.asarray(qt.dequantize()) == 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("q", [Float8CurrentScaling(), Float8CurrentScaling("e5m2"), NVFP4(), MXFP8(),
                               Float8Block()], ids=lambda q: q.label)
def test_nan_inf_show_up(q, bad):
    x = rand(16, (32, 128)).at[3, 5].set(bad)
    qt = quantize(x, q)
    d = np.asarray(qt.dequantize())
    assert not np.isfinite(d[3, 5]), "the poisoned element must not come back finite"
    if qt.rowwise.amax is not None:  # per-tensor amax: non-finite, and so is the whole tensor
        assert not np.isfinite(float(qt.rowwise.amax))
        assert not np.any(np.isfinite(d))


def test_errors_name_shape_dtype_and_quantizer():
    with pytest.raises(QuantizationError, match=r"\(7,\).*mxfp8_e4m3"):
        quantize(jnp.ones((7,)), MXFP8())
    with pytest.raises(QuantizationError, match=r"\(4, 4\).*int32.*nvfp4"):
        quantize(jnp.ones((4, 4), jnp.int32), NVFP4())
    with pytest.raises(QuantizationError, match="multiple of 16"):
        quantize(jnp.ones((10, 32)), NVFP4(rht=True))
    with pytest.raises(ValueError, match="usage"):
        quantize(jnp.ones((4, 32)), MXFP8(), "sideways")
    with pytest.raises(TypeError, match="plain quantizer"):
        Hybrid(MXFP8(), None)


# ---------------------------------------------------------------- Hybrid

PLAIN = [Float8CurrentScaling(), MXFP8(), NVFP4(), NVFP4(rht=True), Float8Block((1, 128)), Identity()]


@pytest.mark.parametrize("a,b", list(itertools.product(PLAIN, PLAIN)), ids=lambda q: q.label)
def test_hybrid_copies_equal_single_format_copies(a, b):
    x = rand(17, (64, 96), jnp.bfloat16)
    h = quantize(x, Hybrid(a, b))
    ra, cb = quantize(x, a).rowwise, quantize(x, b).columnwise
    for got, want in ((h.rowwise, ra), (h.columnwise, cb)):
        assert got.quantizer == want.quantizer and got.axis == want.axis
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(bits(u), bits(v))


@pytest.mark.parametrize("q", PLAIN + [NVFP4(stochastic_rounding=True)], ids=lambda q: q.label)
def test_hybrid_of_same_is_same(q):
    x = rand(18, (32, 64))
    k = jax.random.PRNGKey(1)
    a, b = quantize(x, q, key=k), quantize(x, Hybrid(q, q), key=k)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(bits(u), bits(v))


# ---------------------------------------------------------------- delayed scaling

def test_delayed_scaling_history_and_scale():
    q = Float8DelayedScaling("e4m3", history_len=4, amax_compute="max", margin=1)
    st = init_state(q)
    amaxes = []
    for i in range(6):
        x = rand(20 + i, (16, 32), scale=float(i + 1))
        qt = quantize(x, q, state=st)
        np.testing.assert_array_equal(np.asarray(qt.rowwise.data, np.float32),
                                      np.asarray(casts.saturating_fp8(x * st["scale"], "e4m3"), np.float32))
        amaxes.append(float(jnp.max(jnp.abs(x))))
        st = update_state(q, st, qt)
        hist = (amaxes[::-1] + [0.0] * 4)[:4]
        np.testing.assert_allclose(np.asarray(st["amax_history"]), hist, rtol=0)
        np.testing.assert_allclose(float(st["scale"]), 448.0 / max(hist) / 2.0, rtol=1e-6)


# ---------------------------------------------------------------- transformations

def test_pytree_roundtrip_jit_vmap_checkpoint():
    x = rand(30, (4, 32, 64))
    q = Hybrid(MXFP8(), NVFP4())
    qt = quantize(x, q)
    leaves, tree = jax.tree.flatten(qt)
    qt2 = jax.tree.unflatten(tree, leaves)
    assert isinstance(qt2, QTensor) and qt2.shape == x.shape
    np.testing.assert_array_equal(np.asarray(qt2.dequantize()), np.asarray(qt.dequantize()))
    jitted = jax.jit(lambda v: quantize(v, q))(x)
    np.testing.assert_array_equal(np.asarray(jitted.columnwise.data), np.asarray(qt.columnwise.data))
    # vmap over a leading axis equals quantizing each slice
    vm = jax.vmap(lambda v: quantize(v, q).dequantize())(x)
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(vm[i]), np.asarray(quantize(x[i], q).dequantize()))
    ck = jax.checkpoint(lambda v: quantize(v, q).dequantize().sum())
    assert np.isclose(float(ck(x)), float(qt.dequantize().sum()))


def test_gradients_stop_at_quantize_and_pass_straight_through_fake_quantize():
    x = rand(31, (32, 64))
    g0 = jax.grad(lambda v: quantize(v, MXFP8()).dequantize().sum())(x)
    assert np.all(np.asarray(g0) == 0)
    g1 = jax.grad(lambda v: (fake_quantize(v, MXFP8()) * 3.0).sum())(x)
    np.testing.assert_array_equal(np.asarray(g1), np.full(x.shape, 3.0, np.float32))
    g2 = jax.jit(jax.grad(lambda v: jax.checkpoint(lambda u: fake_quantize(u, NVFP4()).sum())(v)))(x)
    np.testing.assert_array_equal(np.asarray(g2), np.ones(x.shape, np.float32))


# ---------------------------------------------------------------- property tests

@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 140), log_scale=st.floats(-20, 20), seed=st.integers(0, 2**16))
def test_property_mxfp8_elementwise_bound(rows, cols, log_scale, seed):
    x = rand(seed, (rows, cols), scale=float(2.0 ** log_scale))
    s = quantize(x, MXFP8(), ROWWISE).rowwise
    d = np.asarray(s.dequantize(), np.float64)
    xv = np.asarray(x, np.float64)
    scale = np.repeat(np.asarray(s.scale_inv).astype(np.float64), 32, axis=1)[:, :cols]
    # E4M3 keeps 3 mantissa bits: error <= 2^-4 |x| for normals, <= half the subnormal step 2^-10 * scale.
    assert np.all(np.abs(d - xv) <= np.maximum(2.0 ** -4 * np.abs(xv), 2.0 ** -10 * scale) * (1 + 1e-9))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 40), cols=st.integers(2, 100), seed=st.integers(0, 2**16),
       pair=st.sampled_from(list(itertools.product(range(len(PLAIN)), repeat=2))))
def test_property_hybrid_pairs(rows, cols, seed, pair):
    a, b = PLAIN[pair[0]], PLAIN[pair[1]]
    if isinstance(b, NVFP4) and b.rht and rows % 16:
        rows = 16 * max(1, rows // 16)
    x = rand(seed, (rows, cols))
    h = quantize(x, Hybrid(a, b))
    np.testing.assert_array_equal(bits(h.dequantize(ROWWISE)), bits(quantize(x, a, ROWWISE).dequantize(ROWWISE)))
    np.testing.assert_array_equal(bits(h.dequantize(COLUMNWISE)),
                                  bits(quantize(x, b, COLUMNWISE).dequantize(COLUMNWISE)))


@pytest.mark.parametrize("fmt,dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2),
                                       ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_round_to_grid_is_ml_dtypes_rounding(fmt, dtype):
    """The exact rounding the reference casts go through equals ml_dtypes' cast, midpoints and subnormals
    included."""
    from jaxhq.formats.casts import round_to_grid
    rng = np.random.default_rng(abs(hash(fmt)) % 2 ** 32)
    top = float(ml_dtypes.finfo(dtype).max)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 10, 200_000))).astype(np.float32)
    values = np.unique(np.arange(2 ** 16 if np.dtype(dtype).itemsize == 2 else 256, dtype=np.uint16 if
                                 np.dtype(dtype).itemsize == 2 else np.uint8).view(dtype).astype(np.float32))
    values = values[np.isfinite(values)]
    mids = (values[:-1] + (values[1:] - values[:-1]) / 2).astype(np.float32)  # no overflow at the top
    x = np.clip(np.concatenate([x, mids, values]), -top, top)
    got = np.asarray(jax.jit(lambda v: round_to_grid(v, fmt))(x))
    want = x.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_rht_butterfly_is_the_hadamard_matrix():
    """apply_rht's butterfly is v @ T.T with T = H diag(signs) / 4 (float64 numpy), and its inverse is v @ T."""
    from jaxhq.formats.nvfp4 import apply_rht, rht_matrix
    x = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    t = rht_matrix().astype(np.float64)
    blocks = x.astype(np.float64).reshape(8, 4, 16)
    np.testing.assert_allclose(np.asarray(apply_rht(jnp.asarray(x))), (blocks @ t.T).reshape(8, 64), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(apply_rht(jnp.asarray(x), inverse=True)), (blocks @ t).reshape(8, 64),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2],
                         ids=lambda d: jnp.dtype(d).name)
def test_abs_max_is_numpys_with_nan_propagated(dtype):
    """abs_max (the integer max of the |x| bit patterns) and abs_max_f32 against numpy's max |x| in float64,
    over whole arrays and along the last axis: negative zeros, infinities, and a NaN anywhere (canonical NaN
    from abs_max; any NaN from abs_max_f32)."""
    from jaxhq.formats.base import abs_max, abs_max_f32
    x = np.array((jax.random.normal(jax.random.key(5), (48, 80), jnp.float32) * 7).astype(dtype))
    x[0, :] = -0.0
    cases = [x]
    if dtype != jnp.float8_e4m3fn:  # E4M3FN has no infinity
        y = x.copy(); y[5, 7] = -np.inf; cases.append(y)
    z = x.copy(); z[11, 3] = np.nan; cases.append(z)
    for c in cases:
        ref = np.abs(c.astype(np.float64))
        got_rows = np.asarray(abs_max(jnp.asarray(c), axis=-1), np.float64)
        np.testing.assert_array_equal(got_rows, ref.max(axis=-1))
        full = abs_max(jnp.asarray(c))
        np.testing.assert_array_equal(np.float64(full), ref.max())
        np.testing.assert_array_equal(np.float64(abs_max_f32(jnp.asarray(c))), ref.max())
        assert abs_max_f32(jnp.asarray(c)).dtype == jnp.float32
        if np.isnan(ref.max()) and jnp.dtype(dtype).itemsize > 1:  # FP8 NaN codes differ between converters
            canon = np.asarray(jnp.asarray(np.nan, dtype)).reshape(1)
            assert np.asarray(full).reshape(1).view(np.uint8).tobytes() == canon.view(np.uint8).tobytes()
