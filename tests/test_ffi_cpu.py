"""CPU FFI handlers: bit-equal to the jnp reference on fresh random data, outputs poisoned first."""
from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhq.ffi as jffi
from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Hybrid
from jaxhq.formats.hybrid import side

pytestmark = pytest.mark.skipif(not jffi.available("cpu"), reason="jaxhq FFI extension not built")

from test_ffi_checks import (DELAYED, HYBRID, SHAPES, SINGLE, applicable, bf16_rounding_input,  # noqa: E402
                             compare, random_input, reference_copies, spy_launches, state_for, tiny_input)

DTYPES = [jnp.bfloat16, jnp.float32, jnp.float16]
_seed = itertools.count(1000)


def _cases():
    # every quantizer on every shape, the input dtype rotating (bf16 on the shapes RHT can take)
    for i, q in enumerate(SINGLE + HYBRID + [DELAYED]):
        for j, shape in enumerate(SHAPES):
            if not applicable(q, shape):  # RHT needs a multiple of 16 (the error: test_rht_shape_error_before_the_kernel)
                continue
            yield q, shape, DTYPES[(i + j) % len(DTYPES)]


@pytest.mark.parametrize("q,shape,dtype", list(_cases()), ids=lambda v: str(getattr(v, "label", v)))
def test_quantize_matches_reference(q, shape, dtype):
    from jaxhq.ffi.dispatch import format_id, quantize_copies
    from jaxhq.formats.hybrid import side
    x = random_input(jax.random.key(next(_seed)), shape, dtype)
    st = state_for(q)
    # single-copy calls (columnwise-only included) on the first three shapes; both copies everywhere
    usages = [("rowwise", "columnwise")] + ([("rowwise",), ("columnwise",)] if SHAPES.index(shape) < 3 else [])
    for usage in usages:
        got = quantize_copies(x, q, usage, state=st, platform="cpu", poison=True)
        if got is None:  # no side of this usage has a kernel (e.g. the Identity side alone)
            assert all(format_id(side(q, a), a) is None for a in usage)
            continue
        ref = reference_copies(x, q, usage, state=st)
        assert compare(got, ref, f"{q.label} {shape} {jnp.dtype(dtype).name} {usage}") == []


@pytest.mark.parametrize("q,shape,dtype", list(_cases()), ids=lambda v: str(getattr(v, "label", v)))
def test_transposed_launch_matches_reference(q, shape, dtype):
    """x's copies made from x.T where it lies (`transposed=True`, the dense op's weights): bit-equal to the
    reference of x, outputs poisoned first (a side with the Hadamard transform: x is transposed and launched as
    usual)."""
    from jaxhq.ffi.dispatch import quantize_copies
    x = random_input(jax.random.key(next(_seed)), shape, dtype)
    xt = jnp.asarray(np.ascontiguousarray(np.asarray(x).T))  # laid out transposed, as a Flax kernel is
    st = state_for(q)
    got = quantize_copies(xt, q, ("rowwise", "columnwise"), state=st, platform="cpu", poison=True, transposed=True)
    ref = reference_copies(x, q, ("rowwise", "columnwise"), state=st)
    assert compare(got, ref, f"transposed {q.label} {shape} {jnp.dtype(dtype).name}") == []


@pytest.mark.parametrize("q", SINGLE + HYBRID + [DELAYED], ids=lambda v: str(getattr(v, "label", v)))
def test_bf16_input_launch_matches_reference_of_the_cast(q, monkeypatch):
    """float32 x quantized as x.astype(bf16) (`cast_to`, the dense op's master weights), laid out either way:
    bit-equal to the reference of the cast, outputs poisoned first. The launch reads the float32 x with the
    bf16-input option on both copies (no bf16 copy written first), except where a per-tensor amax is taken
    first (FP8 current scaling, NVFP4): XLA's cast carries that pass and the launch reads the cast."""
    from jaxhq.ffi import dispatch, primitives as P
    launches = spy_launches(monkeypatch)
    amax_first = any(isinstance(side(q, a), (Float8CurrentScaling, NVFP4)) for a in ("rowwise", "columnwise"))
    for shape in ((33, 50), (256, 160), (130, 272)):
        if not applicable(q, shape):
            continue
        x = bf16_rounding_input(jax.random.key(next(_seed)), shape)
        st = state_for(q)
        ref = reference_copies(x.astype(jnp.bfloat16), q, ("rowwise", "columnwise"), state=st)
        for transposed in (False, True):
            xin = jnp.asarray(np.ascontiguousarray(np.asarray(x).T)) if transposed else x
            launches.clear()
            got = dispatch.quantize_copies(xin, q, ("rowwise", "columnwise"), state=st, platform="cpu", poison=True,
                                           transposed=transposed, cast_to=jnp.bfloat16)
            assert compare(got, ref, f"bf16 input {q.label} {shape} transposed={transposed}") == []
            (_, dt, row, col), = launches
            if amax_first:
                assert dt == jnp.bfloat16
            else:
                assert dt == jnp.float32
                assert all(o & P.OPT_BF16_INPUT for f, o in (row, col) if f != P.NONE), (row, col)


def test_bf16_input_option_needs_float32_and_both_copies():
    """The handler refuses the bf16-input option on a bf16 x, or on one copy of a launch only."""
    from jaxhq.ffi import primitives as P
    seed, scales = P.seed_words(jnp.zeros(2, jnp.uint32), 32, 64), (jnp.float32(1), jnp.float32(1))
    on = (P.MXFP8, P.OPT_BF16_INPUT)
    for x, row, col in ((jnp.ones((32, 64), jnp.bfloat16), on, (P.NONE, 0)),
                        (jnp.ones((32, 64), jnp.float32), on, (P.MXFP8, 0))):
        with pytest.raises(Exception, match="bfloat16-input option needs float32 x"):
            jax.block_until_ready(P.quantize(x, scales, seed, row, col))


def test_decoded_option_only_for_mxfp8_and_nvfp4():
    """The handler refuses a decoded copy (bf16 values) of a format whose GEMMs read codes, naming the format."""
    from jaxhq.ffi import primitives as P
    seed, scales = P.seed_words(jnp.zeros(2, jnp.uint32), 32, 64), (jnp.float32(1), jnp.float32(1))
    x = jnp.ones((32, 64), jnp.bfloat16)
    for fmt in (P.FP8_TENSOR, P.FP8_BLOCK_1x128):
        with pytest.raises(Exception, match=f"only MXFP8 and NVFP4 copies can be decoded \\(format id {fmt}\\)"):
            jax.block_until_ready(P.quantize(x, scales, seed, (fmt, P.OPT_DECODED), (P.NONE, 0)))


def test_quantize_transposed_through_the_entry_point(monkeypatch):
    """quantize(w, transposed=True) on the kernels equals quantize(w.T) (the reference's transpose) in every
    field; stochastic rounding keeps its scales and draws reproducible numbers; only 2D inputs are taken."""
    from jaxhq.formats import Float8CurrentScaling, MXFP8, QuantizationError, quantize
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    w = random_input(jax.random.key(21), (96, 160), jnp.bfloat16)
    for q in (Float8CurrentScaling(), Hybrid(MXFP8(), NVFP4(block_2d=True)), NVFP4(rht=True)):
        a, b = quantize(w, q, transposed=True), quantize(w.T, q)
        assert a.shape == b.shape == (160, 96) and a.dtype == b.dtype
        assert compare({"rowwise": a.rowwise, "columnwise": a.columnwise},
                       {"rowwise": b.rowwise, "columnwise": b.columnwise}, q.label) == []
    sr, k = NVFP4(stochastic_rounding=True), jax.random.key(5)
    a, a2, b = (quantize(w, sr, key=k, transposed=True), quantize(w, sr, key=k, transposed=True),
                quantize(w.T, sr, key=k))
    for ax in ("rowwise", "columnwise"):
        np.testing.assert_array_equal(np.asarray(a.get(ax).data), np.asarray(a2.get(ax).data))
        np.testing.assert_array_equal(np.asarray(a.get(ax).scale_inv.astype(jnp.float32)),
                                      np.asarray(b.get(ax).scale_inv.astype(jnp.float32)))
    with pytest.raises(QuantizationError, match="2D needed"):
        quantize(w.reshape(2, 48, 160), Float8CurrentScaling(), transposed=True)


@pytest.mark.parametrize("q", [NVFP4(stochastic_rounding=True), NVFP4(rht=True, stochastic_rounding=True)],
                         ids=lambda q: q.label)
def test_stochastic_rounding_unbiased_and_reproducible(q):
    from jaxhq.ffi.dispatch import quantize_copies
    x = random_input(jax.random.key(7), (64, 256), jnp.bfloat16)
    k = jax.random.key(3)
    a = quantize_copies(x, q, key=k, platform="cpu", poison=True)
    b = quantize_copies(x, q, key=k, platform="cpu")
    c = quantize_copies(x, q, key=jax.random.key(4), platform="cpu")
    for ax in ("rowwise", "columnwise"):
        np.testing.assert_array_equal(np.asarray(a[ax].data), np.asarray(b[ax].data))
        assert not np.array_equal(np.asarray(a[ax].data), np.asarray(c[ax].data))
        # scales are deterministic: equal to round-to-nearest's
        rn = quantize_copies(x, NVFP4(block_2d=q.block_2d, rht=q.rht), platform="cpu")
        np.testing.assert_array_equal(np.asarray(a[ax].scale_inv.astype(jnp.float32)),
                                      np.asarray(rn[ax].scale_inv.astype(jnp.float32)))
    # Unbiased: the mean over n draws of each dequantized element is within 5 sigma of the (transformed) input.
    # One draw's error is at most one grid step s (the largest step at |y| <= 6 is 2 in E2M1 units), so its
    # variance is <= s^2/4 and the mean's standard deviation <= s / (2 sqrt(n)) per element, in value units
    # s * scale. We check the mean over elements of the normalized error, whose deviation shrinks further.
    n = 64
    keys = jax.random.split(jax.random.key(11), n)
    deq = [quantize_copies(x, q, ("rowwise",), key=kk, platform="cpu")["rowwise"].dequantize() for kk in keys]
    mean = jnp.mean(jnp.stack(deq), axis=0)
    xs = x.astype(jnp.float32)
    s0 = quantize_copies(x, q, ("rowwise",), key=keys[0], platform="cpu")["rowwise"]
    step = 2.0 * (s0.scale_inv.astype(jnp.float32) / jax.numpy.float32(448 * 6 / float(s0.amax)))
    step = jnp.repeat(step, 16, axis=-1)[:, :x.shape[1]]
    ok = step > 0
    z = jnp.where(ok, (mean - xs) / jnp.where(ok, step / (2 * jnp.sqrt(n)), 1.0), 0.0)
    assert float(jnp.max(jnp.abs(z))) < 6.0  # per element: 6 sigma over ~16k elements
    assert abs(float(jnp.mean(z))) < 5.0 / np.sqrt(float(jnp.sum(ok)))  # the average: 5 sigma


def test_key_words_are_the_keys_data():
    """The stochastic-rounding seed takes a key's own two words (no random-bits kernel per launch): typed and raw
    threefry keys give their data, a wider key (rbg, four words) the xor of its halves; under jit and vmap too."""
    from jaxhq.ffi import primitives as P
    typed, raw = jax.random.key(7), jax.random.PRNGKey(7)
    np.testing.assert_array_equal(np.asarray(P.key_words(typed)), np.asarray(jax.random.key_data(typed)))
    np.testing.assert_array_equal(np.asarray(jax.jit(P.key_words)(raw)), np.asarray(raw, np.uint32))
    wide = jax.random.key(7, impl="rbg")
    d = np.asarray(jax.random.key_data(wide), np.uint32).reshape(-1, 2)
    np.testing.assert_array_equal(np.asarray(P.key_words(wide)), np.bitwise_xor.reduce(d, axis=0))
    keys = jax.random.split(jax.random.key(1), 3)
    np.testing.assert_array_equal(np.asarray(jax.vmap(P.key_words)(keys)), np.asarray(jax.random.key_data(keys)))


def test_amax_and_vmap():
    from jaxhq.ffi import primitives as P
    xs = random_input(jax.random.key(5), (3, 48, 40), jnp.bfloat16)
    am, amr = jax.vmap(lambda x: P.amax(x, rht=True))(xs)
    ref = jnp.max(jnp.abs(xs.astype(jnp.float32)), axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(am), np.asarray(ref))
    from jaxhq.formats.nvfp4 import apply_rht
    ref_r = jnp.stack([jnp.max(jnp.abs(apply_rht(x.T.astype(jnp.float32)))) for x in xs])
    np.testing.assert_array_equal(np.asarray(amr), np.asarray(ref_r))
    # vmap of quantize: each batch element equals its own call
    sc = jnp.ones((3, 2), jnp.float32)
    seed = jnp.broadcast_to(P.seed_words(jnp.zeros((2,), jnp.uint32), 48, 40), (3, 6))
    f = lambda x, s, k: P.quantize(x, (s[0], s[1]), k, (P.MXFP8, 0), (P.FP8_BLOCK_1x128, P.OPT_POW2),  # noqa: E731
                                   want_amax=True)
    batched = jax.vmap(f)(xs, sc, seed)
    np.testing.assert_array_equal(np.asarray(batched[4]), np.asarray(ref))  # the amax output, per element
    for i in range(3):
        one = f(xs[i], sc[i], seed[i])
        for b, o in zip(batched, one):
            np.testing.assert_array_equal(np.asarray(b[i]).reshape(-1).view(np.uint8),
                                          np.asarray(o).reshape(-1).view(np.uint8))


def test_each_copy_reads_its_own_scalar():
    """The rowwise and columnwise copies' scalars are two operands of the launch: with per-tensor FP8 on both
    copies, under vmap, each copy of each batch element is ml_dtypes' saturating cast of x times its own scale
    (powers of two: the products are exact), and its scale_inv is 1 / that scale."""
    import ml_dtypes
    from jaxhq.ffi import primitives as P
    xs = random_input(jax.random.key(11), (3, 32, 48), jnp.bfloat16)
    s_row, s_col = jnp.array([0.5, 2.0, 8.0], jnp.float32), jnp.array([4.0, 0.25, 1.0], jnp.float32)
    seed = jnp.broadcast_to(P.seed_words(jnp.zeros((2,), jnp.uint32), 32, 48), (3, 6))
    f = lambda x, a, b, k: P.quantize(x, (a, b), k, (P.FP8_TENSOR, 0), (P.FP8_TENSOR, 0), poison=True)  # noqa: E731
    rd, rs, cd, cs, _ = jax.vmap(f)(xs, s_row, s_col, seed)
    x = np.asarray(xs.astype(jnp.float32))
    for data, scale_inv, s, v in ((rd, rs, s_row, x), (cd, cs, s_col, x.transpose(0, 2, 1))):
        s = np.asarray(s)
        np.testing.assert_array_equal(np.asarray(scale_inv).reshape(3), 1.0 / s)
        want = np.clip(v * s[:, None, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(np.asarray(data).view(np.uint8), want.view(np.uint8))


def test_scalars_of_the_wrong_size_are_refused():
    """A copy's scalar with more values than x has batch elements is refused, naming both shapes, by the
    primitive and by its partitioned form (the dispatch's)."""
    from jaxhq.ffi import partitioning as PT
    from jaxhq.ffi import primitives as P
    seed = P.seed_words(jnp.zeros(2, jnp.uint32), 32, 64)
    x = jnp.ones((32, 64), jnp.bfloat16)
    fmt = (P.FP8_TENSOR, 0)
    for call in (P.quantize, PT.quantize):
        with pytest.raises(ValueError, match=r"one value per batch element of x \(32, 64\).*\(2,\) and \(\)"):
            call(x, (jnp.ones((2,)), jnp.float32(1)), seed, fmt, fmt)


def test_nvfp4_amaxes_reach_the_launch_unstacked():
    """NVFP4 with RHT reads two amaxes (x's and the Hadamard-transformed one): they go to the launch as the two
    operands they are, with no float32 stack of them in the program (a small kernel per launch on the GPU)."""
    from jaxhq.ffi.dispatch import quantize_copies
    x = random_input(jax.random.key(12), (64, 64), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda x: quantize_copies(x, NVFP4(rht=True), platform="cpu"))(x))
    assert "jaxhq_amax" in text and "jaxhq_quantize" in text
    assert not re.search(r"f32\[2\] = (stack|concatenate)", text)


def test_jit_and_dequantize():
    from jaxhq.ffi.dispatch import dequantize_storage, quantize_copies
    x = random_input(jax.random.key(9), (96, 80), jnp.bfloat16)
    for q in SINGLE:
        if not applicable(q, x.shape):
            continue
        got = jax.jit(lambda x: quantize_copies(x, q, platform="cpu"))(x)
        ref = reference_copies(x, q, ("rowwise", "columnwise"))
        assert compare(got, ref, q.label) == []
        for a in ("rowwise", "columnwise"):
            d = dequantize_storage(got[a], platform="cpu")
            r = ref[a].dequantize()
            np.testing.assert_array_equal(np.asarray(d), np.asarray(r), err_msg=f"{q.label} {a}")


def test_missing_extension_falls_back(monkeypatch):
    from jaxhq.ffi import dispatch
    monkeypatch.setattr(dispatch, "load", lambda: None)
    x = random_input(jax.random.key(1), (32, 32), jnp.bfloat16)
    assert dispatch.quantize_copies(x, SINGLE[0]) is None


def test_hybrid_identity_side_uses_reference():
    from jaxhq.ffi.dispatch import quantize_copies
    x = random_input(jax.random.key(2), (64, 64), jnp.bfloat16)
    q = Hybrid(SINGLE[2], HYBRID[-1].columnwise)
    got = quantize_copies(x, q, platform="cpu")
    np.testing.assert_array_equal(np.asarray(got["columnwise"].data), np.asarray(x.T))


def test_rht_shape_error_before_the_kernel():
    """A shape the RHT cannot take is refused with the reference's error, naming the format and the shape."""
    from jaxhq.ffi.dispatch import quantize_copies
    from jaxhq.formats import QuantizationError
    x = random_input(jax.random.key(9), (33, 50), jnp.bfloat16)
    with pytest.raises(QuantizationError, match=r"nvfp4_rht.*multiple of 16.*\[50, 33\]"):
        quantize_copies(x, NVFP4(rht=True), platform="cpu")


def test_delayed_scaling_state_from_a_tiny_amax_is_finite():
    """The delayed-scaling update caps its next scale as current scaling does (a tiny amax history gave inf)."""
    from jaxhq.formats import Float8DelayedScaling, init_state
    from jaxhq.formats.fp8 import MAX_SCALE
    q = Float8DelayedScaling()
    st = q.update_state(init_state(q), jnp.float32(1e-37))
    assert float(st["scale"]) == MAX_SCALE
    x = jnp.full((4, 128), 1e-37, jnp.float32)
    y = q.quantize_2d(x, state=st).dequantize()
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2 ** -4)


@pytest.mark.parametrize("q", [NVFP4(), NVFP4(block_2d=True), NVFP4(rht=True)], ids=lambda q: q.label)
def test_nvfp4_tiny_tensor_quantizes_to_finite_values(q):
    """A whole tensor below 448 * 6 / FLT_MAX (values near 1e-37): its global encode scale 448 * 6 / amax overflowed
    to inf, and a zero block's scale became 0 * inf = NaN. Capped at 2^118: the kernel equals the reference bit for
    bit (outputs poisoned first), the copies dequantize to finite values, and their relative error is at most 1.5x
    that of the same tensor at ordinary magnitudes (x 1e37: 0.10 there; 0.12 here, where the E4M3 block scales fall
    among E4M3's subnormals, with 2 significant bits instead of 4)."""
    from jaxhq.ffi.dispatch import quantize_copies
    from jaxhq.formats.nvfp4 import MAX_GLOBAL_ENCODE, global_encode
    usage = ("rowwise", "columnwise")
    x = tiny_input(jax.random.key(next(_seed)), (128, 256)).at[0, :32].set(0.0).at[:16, 64:80].set(0.0)
    ref = reference_copies(x, q, usage)
    got = quantize_copies(x, q, usage, platform="cpu", poison=True)
    assert compare(got, ref, f"tiny {q.label}") == []
    ordinary = reference_copies(x * 1e37, q, usage)

    def rel_err(copy, want):
        y = np.asarray(copy.dequantize(), np.float64)
        assert np.isfinite(y).all(), (q.label, copy.axis)
        want = np.asarray(want, np.float64)
        return np.linalg.norm(y - want) / np.linalg.norm(want)

    for axis, want in (("rowwise", x), ("columnwise", x.T)):
        assert rel_err(ref[axis], want) <= 1.5 * rel_err(ordinary[axis], want * 1e37), axis
    assert float(global_encode(jnp.float32(1e-37))) == MAX_GLOBAL_ENCODE


@pytest.mark.parametrize("q", [Float8Block(), Float8Block((128, 128)), Float8Block(power_2_scale=False),
                               Float8CurrentScaling()], ids=lambda q: q.label)
def test_tiny_amax_quantizes_to_finite_values(q):
    """A block (or tensor) of tiny normal values (gradients near 1e-37 meet it in training) overflowed its scale
    448 / amax to inf, and 0 * inf made NaNs (or, just above, scale_inv was a float32 subnormal that flushes to
    0). The scale is capped at 2^126: the copies dequantize to the values within E4M3's rounding (3 mantissa
    bits; E4M3 subnormals below 2^-6 of the block's top, so an absolute floor of 2^-9 * 2^-126), and the kernel
    equals the reference bit for bit, outputs poisoned first."""
    from jaxhq.ffi.dispatch import quantize_copies
    x = tiny_input(jax.random.key(next(_seed)), (128, 256), 128 if isinstance(q, Float8Block) else None)
    x = x.at[0, 0].set(0.0)
    ref = reference_copies(x, q, ("rowwise", "columnwise"))
    got = quantize_copies(x, q, ("rowwise", "columnwise"), platform="cpu", poison=True)
    assert compare(got, ref, f"tiny {q.label}") == []
    for axis, want in (("rowwise", x), ("columnwise", x.T)):
        y = np.asarray(ref[axis].dequantize(), np.float64)
        assert np.isfinite(y).all(), axis
        np.testing.assert_allclose(y, np.asarray(want, np.float64), rtol=2 ** -4, atol=2.0 ** -135)


@pytest.mark.parametrize("q", [Float8Block((1, 128)), MXFP8()], ids=lambda q: q.label)
def test_block_scales_leave_the_launch_rows_inner(q):
    """The launch writes a copy's 1x128 and MXFP8 scales [blocks, R] (csrc/spec.h rows_inner_scale_index; for 1x128
    the layout the FP8 GEMM hands cuBLASLt as it is); primitives.quantize hands them on as [R, blocks]. Both
    against the reference quantizer's scales, for rows and columns that are not multiples of the block."""
    from jaxhq.ffi import primitives as P
    from jaxhq.ffi.dispatch import format_id
    fmt, opts = format_id(q, "rowwise")
    block = 128 if fmt == P.FP8_BLOCK_1x128 else 32
    x = random_input(jax.random.key(next(_seed)), (200, 300), jnp.bfloat16)
    seed, one = P.seed_words(jnp.zeros(2, jnp.uint32), 200, 300), jnp.float32(1)
    args = (x, jnp.zeros((0,), jnp.bfloat16), one.reshape(1), one.reshape(1), seed)
    attrs = dict(row_fmt=np.int32(fmt), row_opts=np.int32(opts), col_fmt=np.int32(fmt), col_opts=np.int32(opts),
                 amax_eps=np.float32(0), act=np.int32(0))
    outs = (P.data_shape_dtype(fmt, opts, 200, 300), P.launch_scale_shape_dtype(fmt, 200, 300),
            P.data_shape_dtype(fmt, opts, 300, 200), P.launch_scale_shape_dtype(fmt, 300, 200),
            jax.ShapeDtypeStruct((0,), jnp.uint8))
    assert fmt in P.ROWS_INNER_SCALES
    assert outs[1].shape == (-(-300 // block), 200) and outs[3].shape == (-(-200 // block), 300)
    raw = jax.ffi.ffi_call("jaxhq_quantize", outs, vmap_method="broadcast_all")(*args, **attrs)
    ref = reference_copies(x, q, ("rowwise", "columnwise"))
    wrapped = P.quantize(x, (one, one), seed, (fmt, opts), (fmt, opts))
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731  (E8M0 and float32 alike, as bytes)
    for got_raw, got, want in ((raw[1], wrapped[1], ref["rowwise"].scale_inv),
                               (raw[3], wrapped[3], ref["columnwise"].scale_inv)):
        np.testing.assert_array_equal(bits(np.ascontiguousarray(np.asarray(got_raw).T)), bits(want))
        np.testing.assert_array_equal(bits(got), bits(want))
