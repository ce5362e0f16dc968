"""CUDA FFI kernels: bit-equal to the jnp reference compiled for the GPU and to the CPU handlers, outputs
poisoned first; stochastic rounding reproducible. Skipped without a GPU (run with `pytest -m gpu`)."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpus(), reason="no GPU")]

from test_ffi_checks import (DELAYED, HYBRID, SHAPES, SINGLE, applicable, as_bytes,  # noqa: E402
                             bf16_rounding_input, compare, decoded_values, random_input, reference_copies,
                             state_for, tiny_input)

from jaxhq.formats import NVFP4, Float8Block, Float8CurrentScaling  # noqa: E402

_seed = itertools.count(5000)
GPU_SHAPES = SHAPES + [(1024, 2048), (640, 4096 + 16), (2049, 384)]
SHAPES_PER_QUANTIZER = 3  # rotating through GPU_SHAPES: every shape is met, each quantizer on 3 of them


@pytest.fixture(scope="module", autouse=True)
def _needs_kernels():
    import jaxhq.ffi as jffi
    if not jffi.available("gpu"):
        pytest.fail("a GPU is present but the CUDA kernels are not registered (extension built without CUDA?)")


def _cases():
    """Every quantizer (plain, hybrid, delayed) on SHAPES_PER_QUANTIZER shapes and in turn each input dtype; the
    first shape of each also checks the single-copy usages and the CPU handler (the logic those add does not
    depend on the shape; the suite must fit one device call)."""
    qs = SINGLE + HYBRID + [DELAYED]
    for i, q in enumerate(qs):
        shapes = [s for s in GPU_SHAPES if applicable(q, s)]  # RHT: a multiple of 16 (test_rht_shape_error...)
        for j in range(SHAPES_PER_QUANTIZER):
            shape = shapes[(i + j * len(qs)) % len(shapes)]
            yield q, shape, (jnp.bfloat16, jnp.float32, jnp.float16)[(i + j) % 3], j == 0


@functools.lru_cache(maxsize=None)
def _kernel_jit(q, usage):
    from jaxhq.ffi.dispatch import quantize_copies
    return jax.jit(lambda x, st: quantize_copies(x, q, usage, state=st, poison=True))


@pytest.mark.parametrize("q,shape,dtype,full", list(_cases()), ids=lambda v: str(getattr(v, "label", v)))
def test_cuda_matches_reference(q, shape, dtype, full):
    from jaxhq.ffi.dispatch import format_id, quantize_copies
    from jaxhq.formats.hybrid import side
    gpu = _gpus()[0]
    x = jax.device_put(random_input(jax.random.key(next(_seed)), shape, dtype), gpu)
    st = state_for(q)
    usages = (("rowwise", "columnwise"), ("rowwise",), ("columnwise",)) if full else (("rowwise", "columnwise"),)
    for usage in usages:
        if all(format_id(side(q, a), a) is None for a in usage):
            assert quantize_copies(x, q, usage, state=st) is None
            continue
        got = _kernel_jit(q, usage)(x, st)
        ref = reference_copies(x, q, usage, state=st)
        assert compare(got, ref, f"{q.label} {shape} {jnp.dtype(dtype).name} {usage}") == []
        if not full:
            continue
        # the CPU handler gives the same bits wherever the reference itself gives the same bits on both
        # platforms (XLA's CPU and GPU backends may cast float32 to FP8 differently: docs/ffi.md)
        cpu_dev = jax.devices("cpu")[0]
        xc = jax.device_put(x, cpu_dev)
        st_c = jax.device_put(st, cpu_dev)
        cpu = quantize_copies(xc, q, usage, state=st_c, platform="cpu")
        with jax.default_device(cpu_dev):
            ref_c = reference_copies(xc, q, usage, state=st_c)
        if compare(ref, ref_c, "") == []:
            assert compare(got, cpu, "cpu vs gpu") == []


@pytest.mark.parametrize("q", [SINGLE[4].__class__(stochastic_rounding=True),
                               SINGLE[4].__class__(rht=True, block_2d=True, stochastic_rounding=True)],
                         ids=lambda q: q.label)
def test_cuda_stochastic_rounding(q):
    from jaxhq.ffi.dispatch import quantize_copies
    gpu = _gpus()[0]
    x = jax.device_put(random_input(jax.random.key(8), (512, 768), jnp.bfloat16), gpu)
    k = jax.random.key(1)
    a = quantize_copies(x, q, key=k, poison=True)
    b = quantize_copies(x, q, key=k)
    xc = jax.device_put(x, jax.devices("cpu")[0])
    c = quantize_copies(xc, q, key=jax.device_put(k, jax.devices("cpu")[0]), platform="cpu")
    for ax in ("rowwise", "columnwise"):
        np.testing.assert_array_equal(np.asarray(a[ax].data), np.asarray(b[ax].data))
        np.testing.assert_array_equal(np.asarray(a[ax].data), np.asarray(c[ax].data))
    # unbiased: the mean over draws approaches the input (see test_ffi_cpu for the bound)
    n = 64
    keys = jax.random.split(jax.random.key(2), n)
    deq = jnp.mean(jnp.stack([quantize_copies(x, q, ("rowwise",), key=kk)["rowwise"].dequantize() for kk in keys]), 0)
    rn = quantize_copies(x, q.__class__(block_2d=q.block_2d, rht=q.rht), ("rowwise",))["rowwise"]
    err_sr = float(jnp.mean(deq - x.astype(jnp.float32)))
    err_rn_one = float(jnp.mean(jnp.abs(rn.dequantize() - x.astype(jnp.float32))))
    assert abs(err_sr) < 0.05 * err_rn_one


def test_cuda_amax_dequantize_vmap():
    from jaxhq.ffi import primitives as P
    from jaxhq.ffi.dispatch import dequantize_storage, quantize_copies
    from jaxhq.formats.nvfp4 import apply_rht
    gpu = _gpus()[0]
    xs = jax.device_put(random_input(jax.random.key(3), (3, 272, 400), jnp.bfloat16), gpu)
    am, amr = jax.jit(jax.vmap(lambda x: P.amax(x, rht=True)))(xs)
    np.testing.assert_array_equal(np.asarray(am), np.asarray(jnp.max(jnp.abs(xs.astype(jnp.float32)), axis=(1, 2))))
    ref_r = jnp.stack([jnp.max(jnp.abs(apply_rht(x.T.astype(jnp.float32)))) for x in xs])
    # the reference's RHT is the kernel's butterfly (same additions in the same order): equal bits
    np.testing.assert_array_equal(np.asarray(amr), np.asarray(ref_r))
    x = xs[0]
    for q in SINGLE:
        got = quantize_copies(x, q)
        ref = reference_copies(x, q, ("rowwise", "columnwise"))
        for a in ("rowwise", "columnwise"):
            np.testing.assert_array_equal(np.asarray(dequantize_storage(got[a])), np.asarray(ref[a].dequantize()),
                                          err_msg=f"{q.label} {a}")
    nan_x = x.at[5, 7].set(jnp.nan)
    for q in SINGLE:
        got = quantize_copies(nan_x, q)
        assert bool(jnp.isnan(got["rowwise"].dequantize()).any()), q.label
    # delayed scaling's amax comes out of the quantize kernel: the reference's NaN (canonical bits) for a NaN input
    for xin in (nan_x, nan_x.astype(jnp.float32)):  # the register-tile kernel and the shared-memory tile kernel
        got = quantize_copies(xin, DELAYED, state=state_for(DELAYED), poison=True)
        ref = reference_copies(xin, DELAYED, ("rowwise", "columnwise"), state=state_for(DELAYED))
        assert compare(got, ref, f"NaN {xin.dtype}") == []


@pytest.mark.parametrize("q", SINGLE + HYBRID + [DELAYED], ids=lambda v: str(getattr(v, "label", v)))
def test_cuda_transposed_launch(q):
    """The dense op's weights: x's copies made by the CUDA kernels from x.T where it lies (`transposed=True`),
    bit-equal to the reference of x, outputs poisoned first (with an RHT side x is transposed and launched as usual).
    One shape per quantizer with partial blocks on both sides where the format takes them."""
    from jaxhq.ffi.dispatch import quantize_copies
    shape = next(s for s in ((2049, 384), (640, 4096 + 16), (1024, 2048)) if applicable(q, s))
    gpu = _gpus()[0]
    x = jax.device_put(random_input(jax.random.key(next(_seed)), shape, jnp.bfloat16), gpu)
    xt = jax.device_put(jnp.asarray(np.ascontiguousarray(np.asarray(x).T)), gpu)
    st = state_for(q)
    usage = ("rowwise", "columnwise")
    got = jax.jit(lambda v, s: quantize_copies(v, q, usage, state=s, poison=True, transposed=True))(xt, st)
    ref = reference_copies(x, q, usage, state=st)
    assert compare(got, ref, f"transposed {q.label} {shape}") == []


@pytest.mark.parametrize("q", SINGLE + HYBRID + [DELAYED], ids=lambda v: str(getattr(v, "label", v)))
def test_cuda_bf16_input_launch(q):
    """float32 x quantized as x.astype(bf16) by the CUDA kernels (`cast_to`: each value rounded as it is read,
    the dense op's master weights), laid out either way: bit-equal to the reference of the cast, outputs poisoned
    first. Ties to even in both directions among the values; partial tiles on both sides where the format
    takes them (the register-tile kernel's edge loads, the tile kernel's for NVFP4)."""
    from jaxhq.ffi.dispatch import quantize_copies
    shape = next(s for s in ((2049, 384), (640, 4096 + 16), (1024, 2048)) if applicable(q, s))
    gpu = _gpus()[0]
    x = bf16_rounding_input(jax.random.key(next(_seed)), shape)
    st = state_for(q)
    usage = ("rowwise", "columnwise")
    ref = reference_copies(x.astype(jnp.bfloat16), q, usage, state=st)
    for transposed in (False, True):
        xin = jax.device_put(jnp.asarray(np.ascontiguousarray(np.asarray(x).T)) if transposed else x, gpu)
        got = jax.jit(lambda v, s: quantize_copies(v, q, usage, state=s, poison=True, transposed=transposed,
                                                   cast_to=jnp.bfloat16))(xin, st)
        assert compare(got, ref, f"bf16 input {q.label} {shape} transposed={transposed}") == []


@pytest.mark.parametrize("q", [Float8Block(), Float8Block((128, 128)), Float8CurrentScaling(), NVFP4(),
                               NVFP4(rht=True)], ids=lambda q: q.label)
def test_cuda_tiny_amax_is_finite_and_equals_reference(q):
    """Blocks (or a tensor) of tiny normal values, whose scale 448 / amax (NVFP4: 448 * 6 / amax) overflowed to inf
    (NaN copies): the CUDA kernels cap it at 2^126 (NVFP4: 2^118) as the reference does, bit for bit, outputs
    poisoned first; the copies are finite."""
    from jaxhq.ffi.dispatch import quantize_copies
    x = tiny_input(jax.random.key(next(_seed)), (256, 384), 256 if isinstance(q, Float8Block) else None)
    usage = ("rowwise", "columnwise")
    for dt in (jnp.bfloat16, jnp.float32):
        xin = jax.device_put(x.astype(dt), _gpus()[0])
        got = jax.jit(lambda v: quantize_copies(v, q, usage, poison=True))(xin)
        ref = reference_copies(xin, q, usage)
        assert compare(got, ref, f"tiny {q.label} {jnp.dtype(dt).name}") == []
        for a in usage:
            assert bool(jnp.isfinite(ref[a].dequantize()).all()), (q.label, a)


@pytest.mark.parametrize("q", [SINGLE[2], NVFP4(), NVFP4(rht=True, stochastic_rounding=True), NVFP4(block_2d=True)],
                         ids=lambda v: str(getattr(v, "label", v)))
def test_cuda_decoded_copies_are_the_dequantize_pass_values(q):
    """Decoded copies (the values as bf16, for the Hopper GEMMs that dequantize their operands) on the GPU: the
    bf16 of each code times its block scale, exactly (the ml_dtypes decode of the same call's codes), outputs
    poisoned first; the GEMM of decoded operands equals the GEMM of the codes bit for bit (the same bf16 GEMM
    reads the same values). The CPU handlers' decoded copies are held to the kernels' by tests/test_cuda_emu.py."""
    from jaxhq.ffi.dispatch import quantize_copies
    from jaxhq.ffi.gemm import blockscaled_gemm
    gpu = _gpus()[0]
    both = ("rowwise", "columnwise")
    x = jax.device_put(random_input(jax.random.key(next(_seed)), (1040, 4096 + 32), jnp.bfloat16), gpu)
    w = jax.device_put(random_input(jax.random.key(next(_seed)), (520, 4096 + 32), jnp.bfloat16), gpu)
    key = jax.random.key(next(_seed)) if q.name == "nvfp4" and q.stochastic_rounding else None
    run = jax.jit(lambda x, dec: quantize_copies(x, q, both, key=key, poison=True, decoded=dec), static_argnums=1)
    codes, dec = run(x, ()), run(x, both)
    for a in both:
        c, d = codes[a], dec[a]
        assert d.decoded and d.data.dtype == jnp.bfloat16 and d.data.shape == c.shape
        np.testing.assert_array_equal(np.asarray(d.scale_inv.astype(jnp.float32)),
                                      np.asarray(c.scale_inv.astype(jnp.float32)))
        want = decoded_values(c.data, c.scale_inv, q.name == "nvfp4", False, *c.shape)
        np.testing.assert_array_equal(as_bytes(d.data).reshape(-1), want)
        # the values are the codes' (dequantize recovers the codes' values from a decoded copy exactly)
        np.testing.assert_array_equal(np.asarray(d.dequantize()), np.asarray(c.dequantize()))
    qw = jax.jit(lambda w, dec: quantize_copies(w, q, ("rowwise",), key=key, decoded=dec), static_argnums=1)
    wc, wd = qw(w, ())["rowwise"], qw(w, ("rowwise",))["rowwise"]
    if q.name == "nvfp4" and q.uses_rht("rowwise"):
        return  # the Hadamard side is the columnwise one; a GEMM needs it on both operands
    gemm = jax.jit(lambda a, b: blockscaled_gemm(a, b, jnp.float32))
    np.testing.assert_array_equal(np.asarray(gemm(dec["rowwise"], wd)), np.asarray(gemm(codes["rowwise"], wc)))
    np.testing.assert_array_equal(np.asarray(gemm(dec["rowwise"], wc)), np.asarray(gemm(codes["rowwise"], wc)))
