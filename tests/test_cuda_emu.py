"""The CUDA kernels' sources run on the CPU emulator (tests/cuda_emu): quantize (every kernel variant), amax
and dequantize, bit-equal to the CPU handlers' implementation (which test_ffi_cpu.py holds bit-equal to the
jnp reference), the GEMMs' bf16 dequantization of MXFP8/NVFP4 operands and the NVFP4 wgmma kernel's fp16
decode against ml_dtypes decodes. Fresh
random data; outputs poisoned twice (two byte values, so every byte is proven written); the block's threads
scheduled forwards, backwards and shuffled (a missing barrier or a race reads poison). No GPU needed: this checks the kernels' indexing, shared-memory use, barriers and shuffles in CI;
test_ffi_gpu.py checks the same sources compiled by nvcc on a GPU.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxhq.ffi import primitives as P
from jaxhq.ffi.dispatch import format_id
from jaxhq.formats import MXFP8, NVFP4, Hybrid
from jaxhq.formats.hybrid import side

from test_ffi_checks import HYBRID, SHAPES, SINGLE, applicable, decoded_values, random_input  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "jaxhq" / "ffi" / "csrc"
EMU = ROOT / "tests" / "cuda_emu"
ORDERS = (0, 1, 7)  # forwards, backwards, shuffled
VARIANTS = (0, 2)  # QuantizeVariant: the tile kernel, the register-tile kernel
DTYPES = {1: ml_dtypes.bfloat16, 0: np.float32, 2: np.float16}  # InDtype ids
POISONS = (0xFF, 0x5A)


def _cuda_include():
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (pathlib.Path(base) / "include" / "cuda_runtime.h").exists():
            return pathlib.Path(base) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = pathlib.Path(os.path.realpath(nvcc)).parent.parent / "include"
        if (inc / "cuda_runtime.h").exists():
            return inc
    return None


@pytest.fixture(scope="session")
def emu(tmp_path_factory):
    """The kernels and the CPU implementation, compiled by the host C++ compiler into one library."""
    inc, cxx = _cuda_include(), shutil.which(os.environ.get("CXX", "g++"))
    if inc is None or cxx is None:
        pytest.skip("needs CUDA's headers (cuda_runtime.h, cuda_fp8.h) and a C++ compiler to build the emulator")
    out = tmp_path_factory.mktemp("cuda_emu")
    flags = [cxx, "-std=c++17", "-O2", "-fPIC", f"-I{CSRC}", f"-I{EMU}", f"-I{inc}"]
    jobs = [flags + ["-w", "-include", str(EMU / "cuda_emu.h"), "-x", "c++", "-c", str(CSRC / f"{n}.cu"), "-o",
                     str(out / f"{n.replace('/', '_')}.o")]
            for n in ("cuda_quantize", "cuda_quantize_regs", "cuda_amax", "cuda_dequantize", "gemm/gemm_kernels")]
    jobs += [flags + ["-c", str(CSRC / "cpu_quantize.cc"), "-o", str(out / "cpu_quantize.o")],
             flags + ["-c", str(EMU / "harness.cc"), "-o", str(out / "harness.o")]]
    procs = [subprocess.Popen(j, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for j in jobs]
    for p, j in zip(procs, jobs):
        log = p.communicate()[0]
        assert p.returncode == 0, f"{' '.join(j)}\n{log[-4000:]}"
    lib_path = out / "libjaxhq_cuda_emu.so"
    subprocess.run([cxx, "-shared", "-o", str(lib_path), *map(str, out.glob("*.o"))], check=True)
    lib = ctypes.CDLL(str(lib_path))
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64  # harness.cc's signatures
    lib.emu_quantize.argtypes = [ptr, i32, i64, i64, i64, ptr, ptr, ctypes.c_float, ptr, i32, i32, ptr, ptr, i32,
                                 i32, ptr, ptr, ptr, i32, i32, ptr, i32]
    lib.emu_amax.argtypes = [ptr, i32, i64, i64, i64, i32, ptr, ptr, i32, i32]
    lib.emu_dequantize.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i64, i64, i64, i32, i32]
    lib.emu_dequant_mxfp8.argtypes = [ptr, ptr, i64, i64, i32, i32, i64, ptr, i32]
    lib.emu_dequant_nvfp4.argtypes = [ptr, ptr, i64, i64, ptr, i32]
    lib.emu_stage_scales.argtypes = [ptr, i64, i64, ptr, i64, i64, i32] * 2 + [i32]
    lib.emu_nvfp4_decode.argtypes = [ptr, ptr, i64, ptr, ptr]
    lib.emu_nvfp4_decode.restype = None
    lib.emu_e2m1_mismatches.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib.emu_e2m1_mismatches.restype = ctypes.c_uint64
    lib.emu_e2m1_value_mismatches.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    lib.emu_e2m1_value_mismatches.restype = ctypes.c_uint64
    lib.emu_e2m1_sr_mismatches.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                           ctypes.POINTER(ctypes.c_uint64)]
    lib.emu_e2m1_sr_mismatches.restype = ctypes.c_uint64
    for fn in (lib.emu_quantize, lib.emu_amax, lib.emu_dequantize, lib.emu_dequant_mxfp8, lib.emu_dequant_nvfp4,
               lib.emu_stage_scales):
        fn.restype = ctypes.c_char_p
    return lib


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _nbytes(fmt, opts, r, c):
    """(data bytes, scale bytes) of one [r, c] copy, from the primitives' output shapes."""
    return P.nbytes(P.data_shape_dtype(fmt, opts, r, c)), P.nbytes(P.scale_shape_dtype(fmt, r, c))


def _quantize(lib, x, row, col, scales, seed, variant, order, poison, eps=0.0, dy=None, act=0):
    """(error text, [row data, row scale, col data, col scale] bytes, amax [batch] float32) of one call;
    variant -1: CPU code. scales [batch, 2] (one per copy) or [batch, 1] (shared). act, dy: the copies of that
    activation's gradient, x being its input (P.quantize's act)."""
    batch, m, k = x.shape
    sizes = (*_nbytes(*row, m, k), *_nbytes(*col, k, m))
    outs = [np.full(max(batch * n, 1), poison, np.uint8) for n in sizes]
    amax = np.full(batch, np.float32(-1))
    dtype_id = next(i for i, d in DTYPES.items() if np.dtype(d) == x.dtype)
    s_row, s_col = (np.ascontiguousarray(scales[:, i]) for i in (0, -1))  # [batch, 1]: one array for both
    err = lib.emu_quantize(_ptr(x), dtype_id, batch, m, k, _ptr(s_row), _ptr(s_col), eps, _ptr(seed), row[0],
                           row[1], _ptr(outs[0]),
                           _ptr(outs[1]), col[0], col[1], _ptr(outs[2]), _ptr(outs[3]), _ptr(amax), variant, order,
                           None if dy is None else _ptr(dy), act)
    return err.decode(), [o[:batch * n] for o, n in zip(outs, sizes)], amax


def _fp8_nan(b, e5m2: bool):
    return (b & 0x7F) > 0x7C if e5m2 else (b & 0x7F) == 0x7F


def _differ(got, want, fmt, opts, is_data):
    """Positions where the bytes differ, two FP8 NaN codes counting as equal whatever their sign bit: the sign
    of a NaN made by an invalid operation (inf * 0) is the platform's (negative on x86, positive on a GPU), and
    the emulator runs host arithmetic into the GPU converter's model, which encodes every NaN as 0x7F."""
    bad = got != want
    if is_data and fmt in (P.FP8_TENSOR, P.MXFP8, P.FP8_BLOCK_1x128, P.FP8_BLOCK_128x128):
        e5 = bool(opts & P.OPT_E5M2)
        bad &= ~(_fp8_nan(got, e5) & _fp8_nan(want, e5))
    return np.flatnonzero(bad)


def _ids(q):
    return tuple(format_id(side(q, a), a) or (P.NONE, 0) for a in ("rowwise", "columnwise"))


QUANTIZERS = SINGLE + HYBRID + [NVFP4(stochastic_rounding=True), NVFP4(rht=True, block_2d=True,
                                                                       stochastic_rounding=True)]
_seed = itertools.count(3000)


def _cases():
    shapes = SHAPES + [(257, 385)]
    for i, q in enumerate(QUANTIZERS):
        for j, shape in enumerate(shapes):
            if applicable(q, shape):
                yield q, shape, list(DTYPES)[(i + j) % len(DTYPES)], 2 if j == 0 else 1


def _input(shape, dtype_id, batch, special: bool):
    x = np.array(random_input(jax.random.key(next(_seed)), (batch, *shape), jnp.float32))
    if special:  # NaN and infinities poison their blocks and per-tensor amaxes; the kernels must agree
        flat = x.reshape(-1)
        flat[[3, flat.size // 2]] = np.nan
        flat[[flat.size // 3]] = np.inf
    return np.ascontiguousarray(x.astype(DTYPES[dtype_id]))


def test_e2m1_short_rounding_equals_reference_forms_on_every_float(emu):
    """The kernels' E2M1 rounding by float additions (numerics.h) against the reference's formulas on every bit
    pattern: nearest-even (e2m1_code_finite against the threshold form; NaN excluded: the kernels take that form
    for blocks with a NaN) on all 2^32; stochastic (e2m1_code_sr, one integer addition) against its definition in
    double (up when the distance from below, in grid steps, is >= 1 - (64 k + 31) / 2^22 for the 16 random bits
    k) with k = 0x8000 on all 2^32 and with the extreme draws 0 and 0xFFFF on every magnitude up to 8 of both
    signs. Below 1 the kernels round |y| + 1 to float first, so there a draw within 2^-23 of the threshold may
    go either way: few such, none elsewhere. ctypes releases the GIL: two threads."""
    from concurrent.futures import ThreadPoolExecutor

    def sr(lo, hi, k):
        near = ctypes.c_uint64(0)
        bad = emu.emu_e2m1_sr_mismatches(lo, hi, k, ctypes.byref(near))
        return bad, near.value

    jobs = [(emu.emu_e2m1_mismatches, 0, 0x7FFFFFFF), (emu.emu_e2m1_mismatches, 0x80000000, 0xFFFFFFFF),
            (sr, 0, 0x7FFFFFFF, 0x8000), (sr, 0x80000000, 0xFFFFFFFF, 0x8000)]
    jobs += [(sr, lo, lo + 0x41000000, k) for k in (0, 0xFFFF) for lo in (0, 0x80000000)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda j: j[0](*j[1:]), jobs))
    assert got[:2] == [0, 0]
    assert [bad for bad, _ in got[2:]] == [0] * (len(jobs) - 2)
    # the window holds the floats within 2^-24 of a threshold a = lo + u / 2: at most 2^18 (k = 0xFFFF puts it
    # near 2^-18, where floats are 2^-41 apart), a handful elsewhere
    assert all(near <= 2 ** 19 for _, near in got[2:]), got


def test_e2m1_values_equal_the_values_of_the_codes_on_every_float(emu):
    """Decoded NVFP4 copies take each element's rounded value straight from the rounding (numerics.h e2m1_round*)
    instead of decoding its code: the same bits as e2m1_value of the code (signed zeros and NaN inputs included),
    nearest and stochastic (k = 0x8000 on every float; the extreme draws 0 and 0xFFFF on every magnitude up to 8
    of both signs). ctypes releases the GIL: two threads."""
    from concurrent.futures import ThreadPoolExecutor
    jobs = [(0, 0x7FFFFFFF, 0x8000), (0x80000000, 0xFFFFFFFF, 0x8000)]
    jobs += [(lo, lo + 0x41000000, k) for k in (0, 0xFFFF) for lo in (0, 0x80000000)]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda j: emu.emu_e2m1_value_mismatches(*j), jobs)) == [0] * len(jobs)


@pytest.mark.parametrize("q,shape,dtype_id,batch", list(_cases()),
                         ids=lambda v: str(getattr(v, "label", v)))
def test_quantize_kernel_matches_cpu_code(emu, q, shape, dtype_id, batch):
    row, col = _ids(q)
    rng = np.random.default_rng(next(_seed))
    # the last pass gives a Hadamard-transformed NVFP4 side values up to about 1e37 and an amax of 3e38 (above
    # 2688 * 2^115: a global encode < 2^-115), where the kernel applies the transform's factor 1/4 to a 16-bit tile's
    # sums itself instead of leaving it to the encode multiplier (float16 cannot hold such values)
    passes = [((row, col), False, False), ((row, (P.NONE, 0)), True, False), (((P.NONE, 0), col), False, False)]
    if col[0] == P.NVFP4 and col[1] & P.OPT_RHT and DTYPES[dtype_id] != np.float16:
        passes.append((((P.NONE, 0), col), False, True))
    for usage, special, huge in passes:
        if usage[0][0] == P.NONE and usage[1][0] == P.NONE:
            continue
        x = _input(shape, dtype_id, batch, special)
        if huge:
            x = (x.astype(np.float32) * np.float32(1e33)).astype(x.dtype)
        # per-tensor copies: the scalar is a scale, or (FROM_AMAX: FP8 current scaling, NVFP4) an amax, shared by
        # both copies in the special case, which also takes an eps above some amaxes
        scales = rng.uniform(0.5, 300.0, (batch, 1 if special else 2)).astype(np.float32)
        if huge:
            scales = np.full_like(scales, 3e38)
        eps = 1.0 if special else 0.0
        seed = np.array([[*rng.integers(0, 2 ** 32, 2), 0, 0, *shape]] * batch, np.uint32)
        err, want, want_amax = _quantize(emu, x, *usage, scales, seed, -1, 0, 0, eps)
        assert err == ""
        if huge:  # the block scales are not all zero, so the values reach the comparison
            assert np.any(want[3] != 0), f"{q.label} {shape}: every scale of the huge pass is 0"
        np.testing.assert_array_equal(want_amax, np.max(np.abs(x.astype(np.float32)), axis=(1, 2)))  # NaN: NaN
        for variant, order, poison in itertools.product(VARIANTS, ORDERS, POISONS):
            err, got, got_amax = _quantize(emu, x, *usage, scales, seed, variant, order, poison, eps)
            assert err == "", err
            np.testing.assert_array_equal(got_amax, want_amax)  # the amax output, NaN whatever its payload
            for i, (name, g, w) in enumerate(zip(("row data", "row scale", "col data", "col scale"), got, want)):
                bad = _differ(g, w, *usage[i // 2], is_data=i % 2 == 0)
                assert bad.size == 0, (f"{q.label} {shape} batch {batch} {usage} variant {variant} order {order} "
                                       f"poison {poison:#x}: {name} differs at {bad.size} of {g.size} bytes, "
                                       f"first {bad[:5]}")


@pytest.mark.parametrize("shape", [(64, 96), (272, 200)])
@pytest.mark.parametrize("q", [MXFP8(), MXFP8("e5m2"), NVFP4(), Hybrid(NVFP4(stochastic_rounding=True),
                                                                       NVFP4(rht=True, stochastic_rounding=True)),
                               NVFP4(block_2d=True), Hybrid(MXFP8(), NVFP4(rht=True))],
                         ids=lambda v: str(getattr(v, "label", v)))
def test_decoded_copies_hold_the_values_of_the_codes(emu, q, shape):
    """A decoded copy (OPT_DECODED: the values as bfloat16 instead of the codes, for a GEMM that dequantizes its
    operands anyway) holds exactly the ml_dtypes decode of the codes the same call writes without the option,
    times their block scales; both kernels equal the CPU code, the scales are the undecoded call's, outputs
    poisoned first. Rows and columns that are not whole tiles or blocks included."""
    row, col = _ids(q)
    dec = tuple((f, o | P.OPT_DECODED) for f, o in (row, col))
    for dtype_id in (1, 0):
        x = _input(shape, dtype_id, 1, False)
        rng = np.random.default_rng(next(_seed))
        scales = rng.uniform(0.5, 300.0, (1, 2)).astype(np.float32)
        seed = np.array([[*rng.integers(0, 2 ** 32, 2), 0, 0, *shape]], np.uint32)
        err, codes, _ = _quantize(emu, x, row, col, scales, seed, -1, 0, 0)
        assert err == ""
        err, want, _ = _quantize(emu, x, *dec, scales, seed, -1, 0, 0)
        assert err == ""
        for i, (f, o) in enumerate((row, col)):
            r, c = shape if i == 0 else shape[::-1]
            np.testing.assert_array_equal(want[2 * i + 1], codes[2 * i + 1])  # the scales: as without the option
            np.testing.assert_array_equal(want[2 * i], decoded_values(codes[2 * i], codes[2 * i + 1], f == P.NVFP4,
                                                                      o & P.OPT_E5M2, r, c, f == P.MXFP8))
        for variant, order, poison in itertools.product(VARIANTS, ORDERS, POISONS):
            err, got, _ = _quantize(emu, x, *dec, scales, seed, variant, order, poison)
            assert err == "", err
            for i, (g, w) in enumerate(zip(got, want)):
                assert np.array_equal(g, w), (q.label, shape, dtype_id, variant, order, poison, i)


@pytest.mark.parametrize("act", [P.ACT_SILU | P.GATED, P.ACT_GELU, P.ACT_RELU | P.GATED], ids=["swiglu", "gelu",
                                                                                           "reglu"])
@pytest.mark.parametrize("fmt", [(P.MXFP8, P.OPT_DECODED), (P.FP8_BLOCK_1x128, 0), (P.FP8_BLOCK_128x128, 0),
                                 (P.FP8_TENSOR, P.OPT_E5M2)], ids=["mxfp8_dec", "block1x128", "block128", "e5m2"])
def test_activation_gradient_copies_match_cpu_code(emu, act, fmt):
    """The register-tile kernel's copies of an activation's gradient, made in its loads from h and dy, equal the
    CPU code's, which writes the gradient and then quantizes it (on the emulator both compute the gradient in the
    CPU's float32), with the amax output; outputs poisoned first. Shapes: gated halves of whole tiles (FP8
    formats: a gate and its up tile per CTA), the same with a partial row tile, halves of 100 columns (a tile per
    CTA, no vector loads; the plain activation: partial column tiles)."""
    gated = bool(act & P.GATED)
    for m, k in ((256, 512), (136, 256), (40, 200)):
        rng = np.random.default_rng(next(_seed))
        h = (3 * rng.standard_normal((1, m, k))).astype(ml_dtypes.bfloat16)
        dy = rng.standard_normal((1, m, k // 2 if gated else k)).astype(ml_dtypes.bfloat16)
        scales = np.array([[0.75, 2.0]], np.float32)
        seed = np.array([[1, 2, 0, 0, m, k]], np.uint32)
        err, want, want_amax = _quantize(emu, h, fmt, fmt, scales, seed, -1, 0, 0, dy=dy, act=act)
        assert err == ""
        for order, poison in itertools.product(ORDERS, POISONS):
            err, got, got_amax = _quantize(emu, h, fmt, fmt, scales, seed, 2, order, poison, dy=dy, act=act)
            assert err == "", err
            np.testing.assert_array_equal(got_amax, want_amax)
            for i, (g, w) in enumerate(zip(got, want)):
                bad = _differ(g, w, *fmt, is_data=i % 2 == 0)
                assert bad.size == 0, (act, fmt, (m, k), order, poison, i, bad[:5])


@pytest.mark.parametrize("offsets", [(5, 3), (54366627, 7)], ids=["odd", "pair-index-crosses-2^32"])
@pytest.mark.parametrize("q", [NVFP4(stochastic_rounding=True), Hybrid(NVFP4(rht=True, stochastic_rounding=True),
                                                                      NVFP4(block_2d=True, stochastic_rounding=True))],
                         ids=lambda q: q.label)
def test_stochastic_rounding_at_shard_offsets(emu, q, offsets):
    """A shard's stochastic draws come from its global position (seed words: row and column offsets, the global
    shape). Odd column offsets start chunks on odd global columns (the kernel's second pairing of hashes), and a
    large row offset puts chunks whose pair indices cross 2^32 (the kernel's per-element path): the tile kernel
    equals the CPU code there, outputs poisoned first."""
    shape, (roff, coff) = (48, 80), offsets
    x = _input(shape, 1, 1, False)
    # global shape (roff + 57, coff + 151): with (54366627, 7), row 47's chunk from column 64 of the rowwise copy
    # has pair indices 2^32 - 15 ...
    seed = np.array([[123456789, 987654321, roff, coff, roff + shape[0] + 9, coff + shape[1] + 71]], np.uint32)
    scales = np.array([[0.75, 1.5]], np.float32)
    row, col = _ids(q)
    err, want, _ = _quantize(emu, x, row, col, scales, seed, -1, 0, 0)
    assert err == ""
    for order, poison in itertools.product(ORDERS, POISONS):
        err, got, _ = _quantize(emu, x, row, col, scales, seed, 0, order, poison)
        assert err == "", err
        for i, (g, w) in enumerate(zip(got, want)):
            assert _differ(g, w, *(row, col)[i // 2], is_data=i % 2 == 0).size == 0, (q.label, offsets, order, i)


@pytest.mark.parametrize("shape", [(1, 7), (300, 17), (257, 385), (64, 96), (300, 520), (528, 264)])
@pytest.mark.parametrize("dtype_id", list(DTYPES))
def test_amax_kernel_matches_cpu_code(emu, shape, dtype_id):
    rht = shape[0] % 16 == 0
    for special in (False, True):
        x = _input(shape, dtype_id, 2, special)
        res = []
        for kernel, order in ((0, 0), *((1, o) for o in ORDERS)):
            am, ar = np.full(2, np.float32(-1)), np.full(2, np.float32(-1))
            assert emu.emu_amax(_ptr(x), dtype_id, 2, *shape, int(rht), _ptr(am), _ptr(ar), kernel, order) == b""
            res.append((am, ar))
        for am, ar in res[1:]:  # as floats: NaN equals NaN whatever its payload (the converters' differ)
            np.testing.assert_array_equal(am, res[0][0])
            np.testing.assert_array_equal(ar, res[0][1])


@pytest.mark.parametrize("q", SINGLE, ids=lambda q: q.label)
def test_dequantize_kernel_matches_cpu_code(emu, q):
    shape = (130, 272)
    fmt, opts = format_id(q, "rowwise")
    x = _input(shape, 1, 1, False)
    rng = np.random.default_rng(next(_seed))
    scales = rng.uniform(0.5, 300.0, (1, 2)).astype(np.float32)
    seed = np.array([[1, 2, 0, 0, *shape]], np.uint32)
    err, (data, scale, _, _), _ = _quantize(emu, x, (fmt, opts), (P.NONE, 0), scales, seed, -1, 0, 0)
    assert err == ""
    if fmt in P.ROWS_INNER_SCALES:  # the launch's [blocks, rows] to the [rows, blocks] the dequantize reads
        word = scale.view(np.uint32 if fmt == P.FP8_BLOCK_1x128 else np.uint8)
        scale = np.ascontiguousarray(word.reshape(-1, shape[0]).T).view(np.uint8).reshape(-1)
    scalar = scales[:, 0].copy()
    outs = []
    for kernel, order in ((0, 0), *((1, o) for o in ORDERS)):
        out = np.full(shape, np.nan, np.float32)
        assert emu.emu_dequantize(_ptr(data), _ptr(scale), _ptr(scalar), _ptr(out), fmt, opts, 1, *shape, kernel,
                                  order) == b""
        outs.append(out)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # every element written (poisoned with NaN: none stays NaN)
    assert not np.isnan(outs[0]).any()


# -- the GEMMs' dequantization to bf16 -------------------------------------------------------------------------
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _bf16_bits(v32):
    """Round-to-nearest-even to bf16 (ml_dtypes), as raw bits; the products are exact in float32."""
    return np.asarray(v32, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _same_bf16(got, want, what):
    """Bit equality, NaN == NaN (a NaN's payload is the converter's)."""
    nan = np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)) & np.isnan(
        want.view(ml_dtypes.bfloat16).astype(np.float32))
    bad = np.flatnonzero((got != want) & ~nan)
    assert bad.size == 0, f"{what}: {bad.size} of {got.size} values differ, first at {bad[:5]}"


@pytest.mark.parametrize("k", [32, 96, 1024, 40])  # 40: not a multiple of 32, the 8-element kernel
@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("rows_inner,batch", [(False, 1), (True, 1), (True, 3)],
                         ids=["rows_blocks", "rows_inner", "rows_inner_stacked3"])
def test_gemm_dequant_mxfp8_matches_ml_dtypes(emu, k, e5m2, rows_inner, batch):
    """The GEMMs' MXFP8 dequantize against ml_dtypes, with the scales [rows, blocks] or [blocks, rows] (rows_inner:
    as the quantize launch writes them), of one operand or of `batch` stacked ones (the grouped GEMM's weights:
    each one's scales [blocks, rows / batch])."""
    rng = np.random.default_rng(next(_seed))
    rows, nb = 37 * batch, -(-k // 32)
    data = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    scales = rng.integers(100, 155, (rows, nb), dtype=np.uint8)
    scales[0, 0], scales[1, 0], scales[2, 0] = 0, 0xFF, 254  # 2^-127, NaN, 2^127
    fp8 = ml_dtypes.float8_e5m2 if e5m2 else ml_dtypes.float8_e4m3fn
    with np.errstate(over="ignore", invalid="ignore"):
        sv = np.where(scales == 0xFF, np.nan, np.ldexp(np.float32(1), scales.astype(np.int32) - 127)).astype(
            np.float32)
        want = _bf16_bits(data.view(fp8).astype(np.float32) * np.repeat(sv, 32, axis=1)[:, :k])
    given = np.ascontiguousarray(scales.reshape(batch, rows // batch, nb).transpose(0, 2, 1)) if rows_inner else scales
    for order in ORDERS:
        out = np.full((rows, k), 0xFFFF, np.uint16)
        assert emu.emu_dequant_mxfp8(_ptr(data), _ptr(given), rows, k, int(e5m2), int(rows_inner), batch, _ptr(out),
                                     order) == b""
        _same_bf16(out, want, f"mxfp8 k={k} e5m2={e5m2} order {order}")


@pytest.mark.parametrize("k", [32, 96, 1024, 48])  # 48: a multiple of 16, not of 32
def test_gemm_dequant_nvfp4_matches_ml_dtypes(emu, k):
    rng = np.random.default_rng(next(_seed))
    rows = 37
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (rows, k // 16), dtype=np.uint8)
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(rows, k)  # low nibble: the even element
    sv = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(invalid="ignore"):
        want = _bf16_bits(E2M1[codes] * np.repeat(sv, 16, axis=1))
    for order in ORDERS:
        out = np.full((rows, k), 0xFFFF, np.uint16)
        assert emu.emu_dequant_nvfp4(_ptr(data), _ptr(scales), rows, k, _ptr(out), order) == b""
        _same_bf16(out, want, f"nvfp4 k={k} order {order}")


def test_nvfp4_wgmma_decode_matches_ml_dtypes(emu):
    """The NVFP4 wgmma kernel's decode (gemm/nvfp4_decode.cuh): every code in every nibble position, times every
    E4M3 scale byte (subnormals and NaN included), is e2m1 * scale * 2^-8 exactly as an fp16, written in the order
    0, 4, 1, 5, 2, 6, 3, 7 (decode8, B's tiles) and as the pairs (c, c + 4) (decode_pair, A's fragments)."""
    rng = np.random.default_rng(next(_seed))
    every = np.array([sum(((c + i) % 16) << (4 * i) for i in range(8)) for c in range(16)], np.uint32)
    words = np.concatenate([np.tile(every, (256, 1)), rng.integers(0, 2**32, (256, 8), dtype=np.uint64)
                            .astype(np.uint32)], axis=1).reshape(-1)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 24)
    out8, pairs = (np.full((words.size, 8), 0xFFFF, np.uint16) for _ in range(2))
    emu.emu_nvfp4_decode(_ptr(words), _ptr(scales), words.size, _ptr(out8), _ptr(pairs))
    codes = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    sv = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    with np.errstate(invalid="ignore"):
        e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        want = (e2m1 * sv[:, None] * 2.0 ** -8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]
    got = out8.view(np.float16).astype(np.float64)
    ok = (got == want) | (np.isnan(got) & np.isnan(want))
    assert ok.all(), f"{(~ok).sum()} values differ, first: word {words[np.argmin(ok.all(1))]:#010x}"
    assert np.isnan(want).sum() == 2 * 24 * 8  # the two NaN scale bytes reached every position
    np.testing.assert_array_equal(pairs, out8)


def _staged(src, out_rows, ld, transpose):
    """numpy: the layout cuBLASLt reads, element (i, j) = src(j, i) or src(i, j), 1 outside src."""
    ext = np.ones((ld, out_rows) if transpose else (out_rows, ld), np.float32)
    r, c = min(src.shape[0], ext.shape[0]), min(src.shape[1], ext.shape[1])
    ext[:r, :c] = src[:r, :c]
    return np.ascontiguousarray(ext.T if transpose else ext)


# (rows, cols, out_rows, ld, transpose) of A and B: 1x128 scales transposed with the leading dimension rounded to
# 4 (and padded rows, the retry), 128x128 scales K-major with ceil(K/128) rounded to 4; extents that do not
# divide the 32 x 32 tile; B smaller and larger than A (blocks outside one job's extent).
STAGE_CASES = [((1000, 3, 3, 1000, True), (8, 3, 8, 4, False)),
               ((17, 40, 40, 32, True), (70, 40, 40, 72, True)),
               ((5, 9, 16, 12, False), None),
               ((33, 2, 2, 48, True), (1, 1, 1, 4, False))]


@pytest.mark.parametrize("case", STAGE_CASES)
def test_gemm_stage_scales_matches_numpy(emu, case):
    rng = np.random.default_rng(next(_seed))
    jobs = [j for j in case if j is not None]
    srcs = [rng.standard_normal(j[:2]).astype(np.float32) for j in jobs]
    for order in ORDERS:
        for poison in (np.nan, -7.0):
            outs = [np.full(j[2] * j[3], poison, np.float32) for j in jobs]
            args = []
            for j, s, o in zip(jobs, srcs, outs):
                args += [_ptr(s), j[0], j[1], _ptr(o), j[2], j[3], int(j[4])]
            if len(jobs) == 1:
                args += [None, 0, 0, None, 0, 0, 0]
            assert emu.emu_stage_scales(*args, order) == b""
            for j, s, o in zip(jobs, srcs, outs):
                want = _staged(s, j[2], j[3], j[4])
                np.testing.assert_array_equal(o.reshape(j[2], j[3]), want, err_msg=f"{j} order {order}")
