"""GPU GEMM kernels (jaxhq.ffi.gemm) against a float64 GEMM of the dequantized operands, for the forward,
dgrad and wgrad operand pairs of every recipe, on fresh random data. Skipped without a GPU.

Bound: relative Frobenius error < 2e-3 for fp32 output. The operands are exact (the reference uses the same
dequantized values; MXFP8/NVFP4 dequantize to bf16 without rounding), so what is left is accumulation:
fp32 in the bf16 path (~1e-6) and, for FP8 tensor cores, Hopper's reduced-precision accumulation inside
each wgmma before cuBLASLt promotes to fp32 (~1e-4 seen). 2e-3 is also the bf16 output-rounding bound
(2^-9), used with 5e-3 for bf16 outputs. Wrong scales or layouts give errors of order 1.
"""
from __future__ import annotations

import json
import os
import re
import secrets

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

from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Identity, quantize  # noqa: E402
from jaxhq.ffi import gemm as G  # noqa: E402
import importlib  # noqa: E402

table = importlib.import_module("jaxhq.ops.gemm")  # the module, not the function jaxhq.ops.gemm

TOL = {jnp.float32: 2e-3, jnp.bfloat16: 5e-3}
RECIPES = {  # (input, weight, grad_output) quantizers, as the named recipes use them
    "fp8": (Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3"), Float8CurrentScaling("e5m2")),
    "fp8_block": (Float8Block((1, 128)), Float8Block((128, 128)), Float8Block((1, 128))),
    "mxfp8": (MXFP8("e4m3"), MXFP8("e4m3"), MXFP8("e4m3")),
    "mxfp8_e5m2_grads": (MXFP8("e4m3"), MXFP8("e4m3"), MXFP8("e5m2")),
    "nvfp4": (NVFP4(rht=True), NVFP4(block_2d=True), NVFP4(rht=True, stochastic_rounding=True)),
}
KERNEL = {"fp8": G.fp8_gemm, "fp8_block": G.fp8_gemm, "mxfp8": G.blockscaled_gemm,
          "mxfp8_e5m2_grads": G.blockscaled_gemm, "nvfp4": G.blockscaled_gemm}
K_, N_ = 256, 384  # layer in/out features: multiples of every block (dgrad contracts over N, wgrad over M)
ERRORS = []


@pytest.fixture(scope="module", autouse=True)
def _needs_kernels():
    if not G.available():
        pytest.fail("a GPU is present but the GEMM kernels are not built/registered")
    yield
    path = os.environ.get("JAXHQ_GEMM_ERRLOG")
    if path:
        with open(path, "w") as f:
            json.dump(ERRORS, f, indent=1)


def _rng():
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _operands(recipe: str, gemm: str, m: int, k: int = K_, n: int = N_):
    """(A, B) storages of one GEMM of a dense layer x[m, k] @ w[k, n], as jaxhq.ops.dense makes them."""
    qx, qw, qdy = RECIPES[recipe]
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.5, 4), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)) * 1e-3, jnp.float32)
    key = jax.random.PRNGKey(seed)
    if gemm == "forward":
        return quantize(x, qx, "rowwise").rowwise, quantize(w.T, qw, "rowwise").rowwise, seed
    if gemm == "dgrad":
        return quantize(dy, qdy, "rowwise", key=key).rowwise, quantize(w.T, qw, "columnwise").columnwise, seed
    return quantize(x, qx, "columnwise").columnwise, quantize(dy, qdy, "columnwise", key=key).columnwise, seed


def _transposed_weight_operands(m: int, bias: bool = False):
    """The nvfp4 recipe's dgrad operands two ways: A (the gradient's rowwise copy), B as the weight's decoded
    rowwise copy read transposed (`Storage.transposed`, what the dense op passes on Hopper) and B as the
    columnwise codes; also a random bias and accumulator [m, K_] when asked."""
    from jaxhq.ffi.dispatch import quantize_copies
    a, _, seed = _operands("nvfp4", "dgrad", m)
    rng = np.random.default_rng(seed + 1)
    w = jnp.asarray(rng.standard_normal((K_, N_)) * 0.05, jnp.float32)
    row = quantize_copies(w.T, RECIPES["nvfp4"][1], ("rowwise",), decoded=("rowwise",))["rowwise"]
    view, col = row.transpose_of(), quantize(w.T, RECIPES["nvfp4"][1], "columnwise").columnwise
    assert row.decoded and view.transposed and view.shape == col.shape == (K_, N_) and view.data.shape == (N_, K_)
    extra = (jnp.asarray(rng.standard_normal(K_), jnp.float32), jnp.asarray(rng.standard_normal((m, K_)), jnp.float32))
    return a, view, col, extra if bias else None, seed


def _tiny_nvfp4_operands(gemm: str):
    """An NVFP4 GEMM (forward or wgrad layouts, as in _operands) whose A is a tensor of values near 1e-36: its amax
    (about 4e-36) is below 448 * 6 / FLT_MAX, where the global encode scale overflowed before it was capped. B is
    scaled up so that the GEMM's alpha (1 / global encode of each operand) and the output stay normal floats.
    Also returns the float64 product of the unquantized operands."""
    qx, qw, qdy = RECIPES["nvfp4"]
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((64, K_)) * 1e-36, jnp.float32)
    w = jnp.asarray(rng.standard_normal((K_, N_)) * 1e3, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((64, N_)) * 1e3, jnp.float32)
    x64 = np.asarray(x, np.float64)
    if gemm == "forward":
        exact = x64 @ np.asarray(w, np.float64)
        return quantize(x, qx, "rowwise").rowwise, quantize(w.T, qw, "rowwise").rowwise, exact, seed
    key = jax.random.PRNGKey(seed)
    exact = x64.T @ np.asarray(dy, np.float64)
    return quantize(x, qx, "columnwise").columnwise, quantize(dy, qdy, "columnwise", key=key).columnwise, exact, seed


def _near_unquantized(out, exact, what):
    """NVFP4 moves each operand by about 10% (relative Frobenius, test_ffi_cpu's tiny-tensor test), so the product
    by about 0.15; 0.3 leaves room, while lost or overflowed scales give 1 or NaN."""
    err = float(np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact))
    assert err < 0.3, f"{what}: relative error {err:.3g} against the unquantized product"


def _dequant64(s):
    q = s.quantizer
    if isinstance(q, NVFP4) and q.uses_rht(s.axis):
        return np.asarray(q.dequantize_transformed(s), np.float64)
    return np.asarray(s.dequantize(), np.float64)


def _reference(a, b):
    av, bv = _dequant64(a), _dequant64(b)
    if isinstance(a.quantizer, NVFP4) and (a.quantizer.uses_rht(a.axis) != b.quantizer.uses_rht(b.axis)):
        raise AssertionError("test bug: RHT on one operand")
    return av @ bv.T


def _check(out, ref, dtype, what):
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    ERRORS.append({"case": what, "rel_err": err})
    assert err < TOL[dtype], f"{what}: relative Frobenius error {err:.3e} >= {TOL[dtype]}"
    return err


def _cases():
    for recipe in RECIPES:
        for gemm in ("forward", "dgrad"):
            for m in (1, 17, 1000):
                yield recipe, gemm, m
        for m in (128, 1024):
            yield recipe, "wgrad", m
    yield "mxfp8", "wgrad", 1000  # a partial 1x32 block along the contraction


def _params():
    for recipe, gemm, m in _cases():
        yield pytest.param(recipe, gemm, m, jnp.float32, id=f"{recipe}-{gemm}-{m}-f32")
        if m == 17:  # bf16 output: the same kernels with a bf16 epilogue
            yield pytest.param(recipe, gemm, m, jnp.bfloat16, id=f"{recipe}-{gemm}-{m}-bf16")


@pytest.mark.parametrize("recipe,gemm,m,dtype", list(_params()))
def test_gemm_matches_float64(recipe, gemm, m, dtype):
    a, b, seed = _operands(recipe, gemm, m)
    out = jax.jit(lambda a, b: KERNEL[recipe](a, b, dtype))(a, b)
    assert out.dtype == dtype
    _check(out, _reference(a, b), dtype, f"{recipe} {gemm} M={m} {jnp.dtype(dtype).name} seed={seed}")


@pytest.mark.parametrize("gemm", ["forward", "wgrad"])
def test_nvfp4_gemm_of_a_tiny_tensor(gemm):
    """The kernel's alpha caps the global encode scale as the quantizer does (it overflowed to inf: NaN or 0 out)."""
    a, b, exact, seed = _tiny_nvfp4_operands(gemm)
    out = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32))(a, b)
    _check(out, _reference(a, b), jnp.float32, f"tiny nvfp4 {gemm} seed={seed}")
    _near_unquantized(out, exact, f"tiny nvfp4 {gemm} seed={seed}")


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bias_and_accumulate(recipe, dtype):
    """out = c + A @ B.T + bias, with c random: an element the kernel fails to write keeps c and fails."""
    a, b, seed = _operands(recipe, "forward", 17)
    rng = np.random.default_rng(seed)
    ref = _reference(a, b)
    scale = np.abs(ref).mean()
    c = jnp.asarray(rng.standard_normal(ref.shape) * scale, dtype)
    bias = jnp.asarray(rng.standard_normal(ref.shape[1]) * scale, dtype)
    fn = jax.jit(lambda a, b, c, bias: KERNEL[recipe](a, b, dtype, bias=bias, accumulate=c))
    out = fn(a, b, c, bias)
    want = ref + np.asarray(c, np.float64) + np.asarray(bias, np.float64)[None, :]
    _check(out, want, dtype, f"{recipe} bias+accumulate {jnp.dtype(dtype).name} seed={seed}")
    out2 = jax.jit(lambda a, b, bias: KERNEL[recipe](a, b, dtype, bias=bias))(a, b, bias)
    _check(out2, ref + np.asarray(bias, np.float64)[None, :], dtype, f"{recipe} bias {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("m", [17, 1000])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias_accumulate"])
def test_dgrad_reads_a_transposed_decoded_weight(m, bias):
    """NVFP4 16x16 weights: dgrad with the forward's decoded weight copy read transposed (b_kn, no dequantize pass)
    against float64 and against the same GEMM of the columnwise codes. Both GEMMs multiply the same bf16 values,
    cuBLASLt in two layouts that may sum in other orders: fp32 results within 1e-5 (relative Frobenius) of each
    other, where their error against float64 is ~1e-6 each; a wrong layout or scale gives order 1."""
    a, view, col, extra, seed = _transposed_weight_operands(m, bias)
    bias_, acc = extra or (None, None)
    run = jax.jit(lambda a, b, bias, acc: G.blockscaled_gemm(a, b, jnp.float32, bias=bias, accumulate=acc))
    assert "b_kn = 1" in run.lower(a, view, bias_, acc).as_text()
    ref = _reference(a, col) + (0 if extra is None else np.asarray(bias_, np.float64) + np.asarray(acc, np.float64))
    out_view, out_col = run(a, view, bias_, acc), run(a, col, bias_, acc)
    _check(out_view, ref, jnp.float32, f"nvfp4 dgrad transposed weight M={m} seed={seed}")
    diff = float(np.linalg.norm(np.asarray(out_view, np.float64) - np.asarray(out_col, np.float64)) /
                 np.linalg.norm(ref))
    assert diff < 1e-5, f"transposed weight against codes: {diff:.3g} (seed {seed})"


@pytest.mark.parametrize("m", [17, 1000])
def test_fp8_fast_accum(m):
    """Hopper's fast FP8 accumulation (opt-in): same bound at K = 256."""
    a, b, seed = _operands("fp8", "forward", m)
    out = jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.float32, fast_accum=True))(a, b)
    _check(out, _reference(a, b), jnp.float32, f"fp8 fast_accum M={m} seed={seed}")


_TUNE_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxhq.formats import MXFP8, Float8Block, Float8CurrentScaling, quantize
from jaxhq.ffi import gemm as G
rng = np.random.default_rng(int(sys.argv[1]))
m, k, n = 1024, 2048, 1536
x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
for name, qa, qb, fn in () if sys.argv[2] == "graphs" else (
        ("fp8", Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3"), G.fp8_gemm),
        ("fp8_block", Float8Block((1, 128)), Float8Block((128, 128)), G.fp8_gemm),
        ("mxfp8_dq", MXFP8("e4m3"), MXFP8("e4m3"), lambda a, b, d: G.blockscaled_gemm(a, b, d, kernel="dequantize"))):
    a, b = quantize(x, qa, "rowwise").rowwise, quantize(w, qb, "rowwise").rowwise
    ref = np.asarray(a.dequantize(), np.float64) @ np.asarray(b.dequantize(), np.float64).T
    out = np.asarray(jax.jit(lambda a, b: fn(a, b, jnp.float32))(a, b), np.float64)
    print(name, float(np.linalg.norm(out - ref) / np.linalg.norm(ref)), flush=True)
if sys.argv[2] != "graphs":
    sys.exit(0)
# One program that XLA records into a CUDA graph (the test's XLA_FLAGS), an accumulating call among its GEMMs (tuned
# on stand-ins); run twice (the replay).
mc = 1152
xc = jnp.asarray(rng.standard_normal((mc, k)), jnp.float32)
cc = jnp.asarray(rng.standard_normal((mc, n)), jnp.float32)
ops = {}
for name, qa, qb in (("fp8", Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3")),
                     ("fp8_block", Float8Block((1, 128)), Float8Block((128, 128)))):
    ops[name] = (quantize(xc, qa, "rowwise").rowwise, quantize(w, qb, "rowwise").rowwise)
def step(ops, c):
    (a0, b0), (a1, b1) = ops["fp8"], ops["fp8_block"]
    return {"captured_fp8": G.fp8_gemm(a0, b0, jnp.float32) * 2.0,
            "captured_fp8_block": G.fp8_gemm(a1, b1, jnp.float32) + 1.0,
            "captured_fp8_accumulate": G.fp8_gemm(a0, b0, jnp.float32, accumulate=c)}
refs = {}
for name, (a, b) in ops.items():
    refs[name] = np.asarray(a.dequantize(), np.float64) @ np.asarray(b.dequantize(), np.float64).T
refs = {"captured_fp8": 2.0 * refs["fp8"], "captured_fp8_block": refs["fp8_block"] + 1.0,
        "captured_fp8_accumulate": refs["fp8"] + np.asarray(cc, np.float64)}
fn = jax.jit(step)
for _ in range(2):
    outs = fn(ops, cc)
for name, out in outs.items():
    out = np.asarray(out, np.float64)
    print(name, float(np.linalg.norm(out - refs[name]) / np.linalg.norm(refs[name])), flush=True)
"""


def test_algorithm_tuning():
    """The first call of a GEMM configuration times cuBLASLt's candidate algorithms and keeps the fastest
    (JAXHQ_GEMM_TUNE): on the call's own operands, or on stand-ins where it accumulates or XLA captures it into a
    CUDA graph before it ever ran. The tuning runs (its verbose lines name a chosen candidate for each
    configuration, and how it was timed) and the chosen algorithms' results hold the bound, replayed from the
    graph too. Fresh processes, as the setting is read once: one without CUDA graphs, one recording every custom
    call into them."""
    import subprocess
    import sys
    seed = secrets.randbits(32)
    errs, lines = {}, {}
    for mode, graphs in (("plain", ""), ("graphs", "FUSION,CUSTOM_CALL")):
        flags = " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_gpu_enable_command_buffer={graphs}",
                          "--xla_gpu_graph_min_graph_size=1"])
        env = dict(os.environ, JAXHQ_GEMM_TUNE="verbose", XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=flags)
        r = subprocess.run([sys.executable, "-c", _TUNE_SCRIPT, str(seed), mode], env=env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        lines[mode] = re.findall(r"jaxhq gemm tune (\S+): candidate (\d+) of (\d+), [^\n]*?ms\)(.*)", r.stderr)
        assert lines[mode], f"{mode}: no tuning line: {r.stderr[-2000:]}"
        assert all(0 <= int(i) < int(n) for _, i, n, _ in lines[mode])
        errs.update(line.split() for line in r.stdout.strip().splitlines())
    # a line per configuration: the three kernels' plain calls, each on its own operands (or one candidate)
    assert len(lines["plain"]) >= 3 and all(how in ("", " (one candidate)") for *_, how in lines["plain"]), lines
    # in the graph: promoted FP8 and blockwise (on their operands where XLA's first run of the graph goes op by
    # op, on stand-ins where it captures them at once) and the accumulating call, on stand-ins either way
    assert len(lines["graphs"]) >= 3 and all(how in ("", " on stand-ins", " (one candidate)")
                                             for *_, how in lines["graphs"]), lines
    assert any(how == " on stand-ins" for *_, how in lines["graphs"]), lines
    assert set(errs) == {"fp8", "fp8_block", "mxfp8_dq", "captured_fp8", "captured_fp8_block",
                         "captured_fp8_accumulate"}, errs
    for name, err in errs.items():
        ERRORS.append({"case": f"tuned {name} seed={seed}", "rel_err": float(err)})
        assert float(err) < TOL[jnp.float32], f"tuned {name}: relative error {err} (seed {seed})"


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("k", [320, 64])
def test_partial_k_blocks(recipe, k):
    """The last 1x128 / 1x32 block along K is partial (zero-padded inside the format); K = 64 < 128."""
    a, b, seed = _operands(recipe, "forward", 1000, k=k)
    out = jax.jit(lambda a, b: KERNEL[recipe](a, b, jnp.float32))(a, b)
    _check(out, _reference(a, b), jnp.float32, f"{recipe} K={k} seed={seed}")


def test_dispatch_table_uses_kernels():
    pairs = table.register_gpu_gemms()
    assert set(pairs) == set(table.gpu_kernels())
    for recipe in ("fp8", "fp8_block", "mxfp8", "nvfp4"):
        a, b, seed = _operands(recipe, "forward", 17)
        fn = table.lookup(table.family(a), table.family(b), "gpu")
        assert getattr(fn, "_jaxhq_ffi_gemm", False), f"{recipe}: table entry {fn} is not the FFI kernel"
        out = jax.jit(lambda a, b: table.gemm(a, b, jnp.float32))(a, b)
        _check(out, _reference(a, b), jnp.float32, f"table {recipe} seed={seed}")


def test_unsupported_shapes_fall_back():
    table.register_gpu_gemms()
    a, b, seed = _operands("fp8", "wgrad", 1000)  # contraction 1000 % 16 != 0: no FP8 GEMM
    with pytest.raises(G.GemmUnsupported):
        G.fp8_gemm(a, b, jnp.float32)
    out = np.asarray(jax.jit(lambda a, b: table.gemm(a, b, jnp.float32))(a, b), np.float64)
    ref = _reference(a, b)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    # the XLA fallback (ops.gemm.fp8_gpu_dot) multiplies the codes by their scales in bf16 (rounding), so 1e-2
    assert np.isfinite(out).all() and err < 1e-2, f"fallback fp8 wgrad M=1000: {err:.3e} (seed {seed})"


@pytest.mark.parametrize("recipe,kernel", [("fp8", "auto"), ("fp8", "cublaslt"), ("fp8_block", "auto"),
                                           ("fp8_block", "cublaslt"), ("mxfp8", "auto"), ("nvfp4", "auto")])
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
def test_grouped(recipe, kernel, accumulate):
    """Ragged groups [5, 0, 700, 200] of T = 1000 rows (95 rows past the groups), one call; FP8 on both of its
    paths (the wgmma kernel by default on a Hopper, cuBLASLt with the sizes read on the host)."""
    qx, qw, _ = RECIPES[recipe]
    rng, seed = _rng()
    t, k, n, sizes = 1000, K_, N_, [5, 0, 700, 200]
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    a = quantize(x, qx, "rowwise").rowwise
    ws = [jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32) for _ in sizes]
    bs = [quantize(w, qw, "rowwise").rowwise for w in ws]
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.float32) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, bias, c: G.grouped_gemm(a, bs, gs, jnp.float32, bias=bias, accumulate=c,
                                                           kernel=kernel))
    out = np.asarray(fn(a, bs, jnp.asarray(sizes, jnp.int32), bias, c), np.float64)
    _check_grouped(out, a, bs, sizes, c, bias, jnp.float32, f"grouped {recipe} accumulate={accumulate} seed={seed}")


def _check_grouped(out, a, bs, sizes, c, bias, dtype, what):
    """A grouped GEMM's output against float64: group g's rows (its size clamped to the rows left) get
    A @ bs[g].T (+ bias[g]) added to c (or to 0); rows past the groups must be zero unless accumulating."""
    av, start = _dequant64(a), 0
    ref = np.zeros(out.shape) if c is None else np.asarray(c, np.float64).copy()
    for g, size in enumerate(sizes):
        rows = slice(start, start + min(size, out.shape[0] - start))
        ref[rows] += av[rows] @ _dequant64(bs[g]).T + (0 if bias is None else np.asarray(bias[g], np.float64)[None])
        start = rows.stop
    if c is None:
        assert (out[start:] == 0).all(), "rows past the groups must be zero"
        if start == 0:  # every row past the groups: nothing else to compare
            return
    _check(out, ref, dtype, what)


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_block", "mxfp8", "nvfp4"])
def test_gemms_in_cuda_graphs_equal_plain_launches(recipe):
    """The dense GEMM targets are command-buffer compatible (temporaries in their workspace result): a dense
    forward + backward with a bias and M % 16 != 0 (the padded retry of block-scaled FP8, the unfused epilogue)
    compiled with XLA's CUDA graphs gives bit for bit what the same HLO gives launched op by op, on fresh
    arrays at every call (new addresses: a graph replaying stale pointers would read the previous call's)."""
    from jaxhq import recipes
    from jaxhq.ops import dense
    table.register_gpu_gemms()
    qs = recipes.get(recipe).dense_quantizers("layer")

    def step(x, w, bias, g, key):
        f = lambda x, w, bias: jnp.sum(dense(x, w, bias, quantizers=qs, key=key) * g)  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1, 2))(x, w, bias)

    m = 1008 if recipe == "nvfp4" else 1000  # the Hadamard transform runs over 16-row blocks of tokens

    def fresh():
        rng, seed = _rng()
        return (jnp.asarray(rng.standard_normal((m, K_)), jnp.bfloat16),
                jnp.asarray(rng.standard_normal((K_, N_)) * 0.05, jnp.float32),
                jnp.asarray(rng.standard_normal(N_), jnp.float32),
                jnp.asarray(rng.standard_normal((m, N_)), jnp.bfloat16), jax.random.PRNGKey(seed)), seed

    args, _ = fresh()
    lowered = jax.jit(step).lower(*args)
    assert "jaxhq_gemm" in lowered.as_text(), "the GEMMs did not run the FFI kernels"
    graphs, plain = lowered.compile(), lowered.compile({"xla_gpu_enable_command_buffer": ""})
    for _ in range(3):
        args, seed = fresh()
        got, want = graphs(*args), plain(*args)
        for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), equal_nan=True), \
                f"{recipe} seed={seed}: output {i} differs between CUDA graphs and plain launches"
        assert np.isfinite(np.asarray(got[0])), f"{recipe} seed={seed}: non-finite loss"


def test_short_workspace_is_an_error_naming_the_bytes():
    """A workspace result smaller than the path needs is an error that says how many bytes it needed."""
    a, b, _ = _operands("fp8_block", "forward", 17)
    need = G.workspace_bytes_fp8(17, N_, K_, G.MODE_VEC128, G.MODE_BLK128, jnp.float32, False)
    empty = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(G.FP8_TARGET, (jax.ShapeDtypeStruct((17, N_), jnp.float32),
                                           jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)))
    with pytest.raises(Exception, match=r"workspace \(\d+ bytes\) is too small .* bytes needed") as err:
        jax.block_until_ready(call(a.data, a.scale_inv, b.data, b.scale_inv, empty, empty, mode_a=np.int32(1),
                                   mode_b=np.int32(2), layout=np.int32(0), pad=np.int32(4),
                                   accumulate=np.int32(0), fast_accum=np.int32(0)))
    # what the handler needed when it ran out is within what jaxhq/ffi/gemm.py gives the sized call
    assert 1 << 20 < int(re.search(r"(\d+) bytes needed", str(err.value)).group(1)) <= need


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_block", "mxfp8", "nvfp4"])
def test_dense_op_uses_kernels(recipe):
    """jaxhq.ops.dense on GPU (forward, dgrad, wgrad through the table) matches the same op with the exact
    dequantized reference GEMM in the table: the quantization is identical, only the GEMMs differ."""
    _dense_op_case(recipe)


def test_dense_op_nvfp4_wgmma(monkeypatch):
    """The same with every NVFP4 GEMM on the kernel that decodes the codes on chip (JAXHQ_NVFP4_GEMM=wgmma): the
    quantize kernels then write codes, not decoded copies, and the dgrad reads the weight's columnwise codes."""
    _hopper_only()
    monkeypatch.setenv("JAXHQ_NVFP4_GEMM", "wgmma")
    _dense_op_case("nvfp4")


def _dense_op_case(recipe):
    """The check of test_dense_op_uses_kernels.

    The reference puts an optimization barrier between quantize and dequantize: without it XLA:GPU's
    simplify-fp-conversions pass (on by default, xla_allow_excess_precision) deletes the f32 -> fp8 -> f32
    round trip inside one jit, and the "reference" silently becomes the unquantized GEMM (seen on the H100:
    2.55% loss difference for mxfp8, equal to 5 digits to the quantized-vs-unquantized gap on the CPU)."""
    from jaxhq import recipes
    from jaxhq.ops import dense
    table.register_gpu_gemms()
    qs = recipes.get(recipe).dense_quantizers("layer")
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((256, K_)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K_, N_)) * 0.05, jnp.float32)
    g = jnp.asarray(rng.standard_normal((256, N_)), jnp.float32)
    key = jax.random.PRNGKey(seed)

    def run():
        def f(x, w):
            y = dense(x, w, quantizers=qs, key=key)
            return jnp.sum(y * g), y
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)

    (loss, y), grads = run()
    saved = dict(table._TABLE)
    try:
        def reference(a, b, out_dtype):
            a, b = jax.lax.optimization_barrier((a, b))
            return table.dequantized_dot(a, b, out_dtype)
        for fa, fb in table.gpu_kernels():
            table.register(fa, fb, reference, platform="gpu")
        (want_loss, want_y), want_grads = run()
    finally:
        table._TABLE.clear()
        table._TABLE.update(saved)
    # The loss is a sum of 256 x N products of both signs, so its own relative error is ill-conditioned (a sum
    # near 0 makes any GEMM difference look large). By Cauchy-Schwarz |loss - want| <= ||y - want_y|| ||g||:
    # dividing by ||want_y|| ||g|| gives the forward GEMM's relative error bound, the quantity held to 2e-3.
    cases = (("y", y, want_y, None), ("dx", grads[0], want_grads[0], None), ("dw", grads[1], want_grads[1], None),
             ("loss", loss, want_loss, float(np.linalg.norm(np.asarray(want_y, np.float64)) * np.linalg.norm(g))))
    for name, a, b, scale in cases:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.linalg.norm(a - b) / (np.linalg.norm(b) if scale is None else scale))
        ERRORS.append({"case": f"dense {recipe} {name} seed={seed}", "rel_err": err})
        assert np.isfinite(a).all() and err < 2e-3, f"dense {recipe} {name}: {err:.3e} (seed {seed})"


# ---- MXFP8 on FP8 wgmma (Hopper). Same bound as above: the operands are exact, each 32-wide K step's wgmma
# partial is scaled by sa * sb (a power of two, exact) and added in fp32, so the error is the tensor core's
# accumulation inside one 32-wide step plus fp32 sums (cuBLASLt's FP8 path, which promotes less often, shows
# ~1.3e-4 at K = 256); 2e-3 (fp32) / 5e-3 (bf16 output rounding) leave room, a wrong scale, swizzle or
# fragment index gives O(1).

def _hopper_only():
    if not G._hopper():
        pytest.skip("needs a Hopper GPU (sm_90a): the FP8 wgmma kernel runs only there")


def _poisoned_call(fn, *args, shape, dtype):
    """Runs fn after freeing a NaN buffer of the output's size, so that XLA's allocator most likely hands the
    kernel NaN-filled memory: an output element the kernel fails to write stays NaN and fails the check."""
    poison = jnp.full(shape, jnp.nan, dtype).block_until_ready()
    del poison
    return fn(*args)


MX_CASES = [(recipe, gemm, m) for recipe in ("mxfp8", "mxfp8_e5m2_grads") for gemm, m in
            [("forward", 1), ("forward", 17), ("forward", 1000), ("dgrad", 17), ("dgrad", 1000),
             ("wgrad", 128), ("wgrad", 1008), ("wgrad", 2048)]]


@pytest.mark.parametrize("recipe,gemm,m", MX_CASES, ids=[f"{r}-{g}-{m}" for r, g, m in MX_CASES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mxfp8_wgmma(recipe, gemm, m, dtype):
    """Forward (E4M3 x E4M3), dgrad (E4M3/E5M2 grads x E4M3 weights) and wgrad (E4M3 x E4M3/E5M2) layouts; odd
    M and partial 128-row tiles; wgrad M = 1008 contracts a partial 1x32 block, 2048 runs the 5-stage ring
    around more than once."""
    _hopper_only()
    a, b, seed = _operands(recipe, gemm, m)
    fn = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, dtype, kernel="wgmma"))
    out = _poisoned_call(fn, a, b, shape=(a.shape[0], b.shape[0]), dtype=dtype)
    _check(out, _reference(a, b), dtype, f"wgmma {recipe} {gemm} M={m} {jnp.dtype(dtype).name} seed={seed}")


@pytest.mark.parametrize("m,k,n", [(300, 2048, 200), (129, 320, 136), (1, 16, 8), (4096, 512, 2304)])
def test_mxfp8_wgmma_shapes(m, k, n):
    """Partial tiles along M and N (N = 200, 136 < 2 x 128), K = 320 (a partial 128-wide K tile), K = 16 (one
    partial MX block), and a shape with more tiles than CTAs (each cluster of two takes several pairs)."""
    _hopper_only()
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    a = quantize(x, MXFP8("e5m2"), "rowwise").rowwise
    b = quantize(w, MXFP8("e4m3"), "rowwise").rowwise
    fn = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32, kernel="wgmma"))
    out = _poisoned_call(fn, a, b, shape=(m, n), dtype=jnp.float32)
    _check(out, _reference(a, b), jnp.float32, f"wgmma {m}x{k}x{n} seed={seed}")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_wgmma_bias_accumulate(recipe, dtype):
    """out = c + A @ B.T + bias with c random, on the MXFP8 and the NVFP4 wgmma kernels: an element the kernel does
    not write keeps c and fails."""
    _hopper_only()
    a, b, seed = _operands(recipe, "forward", 1000)
    rng = np.random.default_rng(seed)
    ref = _reference(a, b)
    scale = np.abs(ref).mean()
    c = jnp.asarray(rng.standard_normal(ref.shape) * scale, dtype)
    bias = jnp.asarray(rng.standard_normal(ref.shape[1]) * scale, dtype)
    fn = jax.jit(lambda a, b, c, bias: G.blockscaled_gemm(a, b, dtype, bias=bias, accumulate=c, kernel="wgmma"))
    want = ref + np.asarray(c, np.float64) + np.asarray(bias, np.float64)[None, :]
    _check(fn(a, b, c, bias), want, dtype, f"wgmma {recipe} bias+accumulate {jnp.dtype(dtype).name} seed={seed}")


# ---- NVFP4 decoded on chip (Hopper, nvfp4_wgmma.cu). The decoded operands are exact (e2m1 * scale * 2^-8 in
# fp16) and fp16 products are exact in the tensor core, so what is left is fp32 accumulation, as on the dequantize
# path; the same bounds hold, and a wrong decode, permutation, swizzle or scale gives O(1).
NV_CASES = [("forward", 1), ("forward", 17), ("forward", 1000), ("dgrad", 17), ("dgrad", 1000), ("wgrad", 128),
            ("wgrad", 1024)]


@pytest.mark.parametrize("gemm,m", NV_CASES, ids=[f"{g}-{m}" for g, m in NV_CASES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nvfp4_wgmma(gemm, m, dtype):
    """The nvfp4 recipe's forward (1x16 x 16x16 blocks), dgrad (stochastically rounded gradients) and wgrad (both
    Hadamard-transformed) layouts; odd M and partial 128-row tiles; wgrad M = 1024 runs the 4-stage ring around
    twice."""
    _hopper_only()
    a, b, seed = _operands("nvfp4", gemm, m)
    fn = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, dtype, kernel="wgmma"))
    out = _poisoned_call(fn, a, b, shape=(a.shape[0], b.shape[0]), dtype=dtype)
    _check(out, _reference(a, b), dtype, f"nvfp4 wgmma {gemm} M={m} {jnp.dtype(dtype).name} seed={seed}")


@pytest.mark.parametrize("m,k,n", [(300, 2048, 200), (129, 320, 136), (1, 32, 8), (4096, 512, 2304), (64, 96, 1024)])
def test_nvfp4_wgmma_shapes(m, k, n):
    """Partial tiles along M and N, K = 320 and 96 (a partial 128-wide K tile: the codes past K come in as zeros
    and their scales are zero), K = 32 (one pair of blocks), more tiles than CTAs; values spread over many
    binades so that small block scales (E4M3 subnormals) and large ones meet in one GEMM."""
    _hopper_only()
    rng, seed = _rng()
    spread = lambda shape: rng.standard_normal(shape) * np.exp2(rng.integers(-12, 6, shape))  # noqa: E731
    x = jnp.asarray(spread((m, k)), jnp.float32)
    w = jnp.asarray(spread((n, k)) * 0.05, jnp.float32)
    a = quantize(x, NVFP4(), "rowwise").rowwise
    b = quantize(w, NVFP4(block_2d=True), "rowwise").rowwise
    fn = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32, kernel="wgmma"))
    out = _poisoned_call(fn, a, b, shape=(m, n), dtype=jnp.float32)
    _check(out, _reference(a, b), jnp.float32, f"nvfp4 wgmma {m}x{k}x{n} seed={seed}")
    short_a, short_b = (quantize(v[:, :16], NVFP4(), "rowwise").rowwise for v in (x, w))
    with pytest.raises(G.GemmUnsupported, match="multiple of 32"):
        G.blockscaled_gemm(short_a, short_b, jnp.float32, kernel="wgmma")


def test_mxfp8_auto_follows_wgmma_wins(monkeypatch):
    """The default MXFP8 path takes the wgmma kernel exactly when G.WGMMA_WINS says it is the faster one (and it
    applies); K % 16 != 0 always falls back to the dequantize path."""
    _hopper_only()
    a, b, _ = _operands("mxfp8", "forward", 17)
    for wins in (False, True):
        monkeypatch.setattr(G, "WGMMA_WINS", wins)
        hlo = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32)).lower(a, b).as_text()
        assert (G.MX_TARGET in hlo) == wins and (G.DQ_TARGET in hlo) != wins
    a, b, _ = _operands("mxfp8", "wgrad", 1000)  # contraction 1000 % 16 != 0
    hlo = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32)).lower(a, b).as_text()
    assert G.MX_TARGET not in hlo and G.DQ_TARGET in hlo
    with pytest.raises(G.GemmUnsupported, match="multiple of 16"):
        G.blockscaled_gemm(a, b, jnp.float32, kernel="wgmma")


WGMMA_GROUPED = {  # (A quantizer, B quantizer, FFI target) on the FP8 wgmma kernel
    "mxfp8": (MXFP8("e4m3"), MXFP8("e4m3"), G.MX_TARGET + "_grouped"),
    "mxfp8_e5m2": (MXFP8("e5m2"), MXFP8("e4m3"), G.MX_TARGET + "_grouped"),
    "fp8": (Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3"), G.FP8_WGMMA_GROUPED),
    "fp8_e5m2": (Float8CurrentScaling("e5m2"), Float8CurrentScaling("e4m3"), G.FP8_WGMMA_GROUPED),
    "fp8_block": (Float8Block((1, 128)), Float8Block((128, 128)), G.FP8_WGMMA_GROUPED),  # N = 1064: partial block
    "fp8_block_1x128": (Float8Block((1, 128)), Float8Block((1, 128)), G.FP8_WGMMA_GROUPED),
}


GROUPED_SIZES = [[5, 0, 700, 200], [128, 256, 1, 127, 300], [0, 0], [600, 600]]
GROUPED_IDS = ["ragged", "tile-edges", "empty", "clamped"]


@pytest.mark.parametrize("sizes", GROUPED_SIZES, ids=GROUPED_IDS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize("recipe", sorted(WGMMA_GROUPED))
def test_wgmma_grouped(recipe, sizes, accumulate):
    """Groups read on the device, for every scaling of the FP8 wgmma kernel: ragged sizes, group edges on and
    off 128-row tiles, all-empty groups (every row past them) and sizes past T = 1000 (clamped like the host
    path: the second group gets 400). N = 1064 is nine tile columns (the last one partial): the second CTA of
    the last pair (clusters of two CTAs share the A tile) computes a column past N and stores nothing."""
    _wgmma_grouped_case(recipe, sizes, accumulate)


@pytest.mark.parametrize("recipe", sorted(WGMMA_GROUPED))
def test_wgmma_grouped_unpaired(recipe, monkeypatch):
    """The kernel launched without clusters (JAXHQ_WGMMA_CLUSTER=1: each CTA loads its whole A tile)."""
    monkeypatch.setenv("JAXHQ_WGMMA_CLUSTER", "1")
    _wgmma_grouped_case(recipe, [5, 0, 700, 200], True)


CUTLASS_CASES = {  # A quantizer, B quantizer, fast accumulation
    "e4m3": (Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3"), False),
    "e4m3-fast": (Float8CurrentScaling("e4m3"), Float8CurrentScaling("e4m3"), True),
    "e5m2": (Float8CurrentScaling("e5m2"), Float8CurrentScaling("e4m3"), False),
    "e5m2-fast": (Float8CurrentScaling("e5m2"), Float8CurrentScaling("e4m3"), True),
    "block": (Float8Block((1, 128)), Float8Block((128, 128)), False),  # N = 1064: a partial 128-row block
}


def _cutlass_only():
    """Skip where CUTLASS's grouped kernel does not exist: not a Hopper, or an extension built without CUTLASS's
    headers (scripts/gpu_check.sh builds with them when the nvidia-cutlass wheel is carried)."""
    _hopper_only()
    if G.FP8_CUTLASS_GROUPED not in G._cuda_targets():
        pytest.skip("the extension was built without CUTLASS (pip install nvidia-cutlass before building)")


@pytest.mark.parametrize("sizes", GROUPED_SIZES, ids=GROUPED_IDS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize("case", sorted(CUTLASS_CASES))
def test_cutlass_grouped(case, accumulate, sizes):
    """Per-tensor and blockwise FP8 grouped on CUTLASS's kernels (their problems built on the device from the
    group sizes), bf16 out: ragged, tile-edge, empty and clamped groups as in test_wgmma_grouped, K = 528 (a
    partial last 128-wide K tile), N = 1064 (a partial last tile column), E4M3 or E5M2 A, promoted or fast
    accumulation; "auto" takes these kernels for such a call and the wgmma kernel once a bias is given."""
    _cutlass_only()
    qa, qb, fast_accum = CUTLASS_CASES[case]
    rng, seed = _rng()
    t, k, n = 1000, 528, 1064
    a = quantize(jnp.asarray(rng.standard_normal((t, k)) * rng.uniform(0.5, 4), jnp.float32), qa, "rowwise").rowwise
    bs = G.stack_storages([quantize(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.01, 0.1), jnp.float32),
                                    qb, "rowwise").rowwise for _ in sizes])
    gs = jnp.asarray(sizes, jnp.int32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, c: G.grouped_gemm(a, bs, gs, jnp.bfloat16, accumulate=c, fast_accum=fast_accum,
                                                     kernel="auto"))
    assert G.FP8_CUTLASS_GROUPED in fn.lower(a, bs, gs, c).as_text()
    with_bias = jax.jit(lambda a, bs, gs, bias: G.grouped_gemm(a, bs, gs, jnp.bfloat16, bias=bias))
    assert G.FP8_WGMMA_GROUPED in with_bias.lower(a, bs, gs, jnp.zeros((len(sizes), n))).as_text()
    out = np.asarray(_poisoned_call(fn, a, bs, gs, c, shape=(t, n), dtype=jnp.bfloat16), np.float64)
    _check_grouped(out, a, [jax.tree.map(lambda x: x[g], bs) for g in range(len(sizes))], sizes, c, None,
                   jnp.bfloat16, f"cutlass grouped {case} {sizes} accumulate={accumulate} seed={seed}")


def test_cutlass_tile_order(monkeypatch):
    """The order the CUTLASS kernels visit output tiles in (JAXHQ_CUTLASS_SWIZZLE, JAXHQ_CUTLASS_RASTER, read at
    each call) moves a tile to another CTA, not its sums: every setting gives the default's output bit for bit,
    along rows and along K; a value outside the allowed ones is an error that names it."""
    _cutlass_only()
    qa, qb, _ = CUTLASS_CASES["block"]
    rng, seed = _rng()
    t, k, n, sizes = 1000, 528, 1064, [300, 0, 500, 200]
    a = quantize(jnp.asarray(rng.standard_normal((t, k)), jnp.float32), qa, "rowwise").rowwise
    bs = G.stack_storages([quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), qb,
                                    "rowwise").rowwise for _ in sizes])
    x1 = quantize(jnp.asarray(rng.standard_normal((k, 1024)), jnp.float32), qa, "rowwise").rowwise  # [M, T]
    y1 = quantize(jnp.asarray(rng.standard_normal((n, 1024)), jnp.float32), qa, "rowwise").rowwise  # [N, T]
    gs, segs = jnp.asarray(sizes, jnp.int32), jnp.asarray([384, 0, 640], jnp.int32)
    rows = jax.jit(lambda a, bs, gs: G.grouped_gemm(a, bs, gs, jnp.bfloat16, kernel="cutlass"))
    along_k = jax.jit(lambda x, y, s: G.segment_gemm(x, y, s))

    def run():
        return [np.asarray(rows(a, bs, gs), np.float32), np.asarray(along_k(x1, y1, segs), np.float32)]
    want = run()
    for swizzle, raster in (("1", "m"), ("2", "n"), ("8", "m"), ("4", "n")):
        monkeypatch.setenv("JAXHQ_CUTLASS_SWIZZLE", swizzle)
        monkeypatch.setenv("JAXHQ_CUTLASS_RASTER", raster)
        for i, (got, ref) in enumerate(zip(run(), want)):
            assert np.array_equal(got, ref, equal_nan=True), \
                f"swizzle {swizzle} raster {raster}: output {i} differs from the default order (seed {seed})"
    monkeypatch.setenv("JAXHQ_CUTLASS_SWIZZLE", "3")
    with pytest.raises(Exception, match="JAXHQ_CUTLASS_SWIZZLE must be 1, 2, 4 or 8, got '3'"):
        jax.block_until_ready(rows(a, bs, gs))
    monkeypatch.setenv("JAXHQ_CUTLASS_SWIZZLE", "4")
    monkeypatch.setenv("JAXHQ_CUTLASS_RASTER", "diagonal")
    with pytest.raises(Exception, match="JAXHQ_CUTLASS_RASTER must be m or n, got 'diagonal'"):
        jax.block_until_ready(along_k(x1, y1, segs))


@pytest.mark.parametrize("case", ["e4m3-fast", "block"])
def test_cutlass_grouped_in_cuda_graphs(case):
    """The CUTLASS grouped call is declared command-buffer compatible: a jitted step that quantizes A, runs two
    grouped calls (the second with the group order reversed) and combines them, compiled with XLA's CUDA graphs,
    gives bit for bit what it gives launched op by op, on fresh operands and fresh group sizes at every call (a
    recorded graph reads the sizes where they are on the device; one replaying the first call's would not)."""
    _cutlass_only()
    qa, qb, fast_accum = CUTLASS_CASES[case]
    t, k, n, groups = 1000, 528, 1064, 5

    def step(x, bs, gs):
        a = quantize(x, qa, "rowwise").rowwise
        one = G.grouped_gemm(a, bs, gs, jnp.bfloat16, fast_accum=fast_accum, kernel="cutlass")
        two = G.grouped_gemm(a, bs, gs[::-1], jnp.bfloat16, fast_accum=fast_accum, kernel="cutlass")
        return one.astype(jnp.float32) * 2 - two, one

    def fresh():
        rng, seed = _rng()
        cuts = np.sort(rng.integers(0, t + 200, groups - 1))  # ragged; the last may run past T (clamped)
        sizes = np.diff(np.concatenate([[0], cuts, [t + 100]]))
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
        bs = G.stack_storages([quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), qb,
                                        "rowwise").rowwise for _ in range(groups)])
        return (x, bs, jnp.asarray(sizes, jnp.int32)), seed

    args, _ = fresh()
    lowered = jax.jit(step).lower(*args)
    assert G.FP8_CUTLASS_GROUPED in lowered.as_text()
    graphs, plain = lowered.compile(), lowered.compile({"xla_gpu_enable_command_buffer": ""})
    for _ in range(3):
        args, seed = fresh()
        got, want = graphs(*args), plain(*args)
        for i, (x, y) in enumerate(zip(got, want)):
            assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), equal_nan=True), \
                f"{case} seed={seed}: output {i} differs between CUDA graphs and plain launches"
        ref = jax.jit(lambda x, bs, gs: G.grouped_gemm(quantize(x, qa, "rowwise").rowwise, bs, gs, jnp.bfloat16,
                                                       fast_accum=fast_accum, kernel="cutlass"))(*args)
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(ref, np.float32),
                                      err_msg=f"{case} seed={seed}: the step's first call differs from a lone call")


@pytest.mark.parametrize("sizes", GROUPED_SIZES, ids=GROUPED_IDS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
@pytest.mark.parametrize("path", ["device", "host"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_grouped_dequantized(fmt, path, accumulate, sizes, monkeypatch):
    """Grouped MXFP8 / NVFP4 on the dequantize path, bf16 out, no bias: both operands dequantized to bf16, then on
    a Hopper with CUTLASS its bf16 grouped kernel with the sizes read on the device ("device"; NVFP4's global
    scales as one alpha per group: every group's weight has its own amax), or the cuBLASLt loop over host-read
    sizes (JAXHQ_DQ_GROUPED=host); ragged, tile-edge, empty and clamped groups, K = 528, N = 1064 (partial tiles),
    accumulate into the output."""
    _hopper_only()
    if path == "host":
        monkeypatch.setenv("JAXHQ_DQ_GROUPED", "host")
    rng, seed = _rng()
    t, k, n = 1000, 528, 1064
    q = MXFP8("e4m3") if fmt == "mxfp8" else NVFP4()
    a = quantize(jnp.asarray(rng.standard_normal((t, k)) * rng.uniform(0.5, 4), jnp.float32), q, "rowwise").rowwise
    bs = G.stack_storages([quantize(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.01, 1), jnp.float32), q,
                                    "rowwise").rowwise for _ in sizes])
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, c: G.grouped_gemm(a, bs, gs, jnp.bfloat16, accumulate=c, kernel="dequantize"))
    out = np.asarray(_poisoned_call(fn, a, bs, jnp.asarray(sizes, jnp.int32), c, shape=(t, n), dtype=jnp.bfloat16),
                     np.float64)
    _check_grouped(out, a, [jax.tree.map(lambda x: x[g], bs) for g in range(len(sizes))], sizes, c, None,
                   jnp.bfloat16, f"{fmt} grouped dequantized ({path}) {sizes} accumulate={accumulate} seed={seed}")


@pytest.mark.parametrize("path", ["device", "host"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_grouped_dequantized_reads_decoded_operands(fmt, path, monkeypatch):
    """Decoded copies (the quantize kernels' bf16 values, what the MoE grouped dispatch hands over on a Hopper) as A
    and as the stacked weights: read where they lie, no dequantize pass, and the result is the codes' bit for bit
    (the same bf16 values into the same kernel)."""
    from jaxhq.ffi.dispatch import quantize_copies
    _hopper_only()
    if path == "host":
        monkeypatch.setenv("JAXHQ_DQ_GROUPED", "host")
    rng, seed = _rng()
    t, k, n, sizes = 1000, 528, 1064, jnp.asarray(GROUPED_SIZES[0], jnp.int32)
    q = MXFP8("e4m3") if fmt == "mxfp8" else NVFP4()
    x = jnp.asarray(rng.standard_normal((t, k)) * rng.uniform(0.5, 4), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.01, 1), jnp.float32) for _ in range(4)]
    dec = lambda v: quantize_copies(v, q, ("rowwise",), decoded=("rowwise",))["rowwise"]  # noqa: E731
    a, bs = dec(x), G.stack_storages([dec(w) for w in ws])
    assert a.decoded and bs.decoded
    fn = jax.jit(lambda a, bs: G.grouped_gemm(a, bs, sizes, jnp.bfloat16))
    got = _poisoned_call(fn, a, bs, shape=(t, n), dtype=jnp.bfloat16)
    want = fn(quantize(x, q, "rowwise").rowwise, G.stack_storages([quantize(w, q, "rowwise").rowwise for w in ws]))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  err_msg=f"{fmt} ({path}) seed={seed}")


@pytest.mark.parametrize("sizes", GROUPED_SIZES, ids=GROUPED_IDS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
def test_bf16_grouped(accumulate, sizes):
    """Two high-precision bf16 operands (the bf16 recipe's MoE layer): CUTLASS's bf16 grouped kernel, the sizes
    read on the device; ragged, tile-edge, empty and clamped groups, K = 528, N = 1064, accumulate."""
    _cutlass_only()
    rng, seed = _rng()
    t, k, n = 1000, 528, 1064
    q = Identity(jnp.bfloat16)
    a = quantize(jnp.asarray(rng.standard_normal((t, k)), jnp.float32), q, "rowwise").rowwise
    bs = G.stack_storages([quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), q,
                                    "rowwise").rowwise for _ in sizes])
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, c: G.grouped_gemm(a, bs, gs, jnp.bfloat16, accumulate=c))
    gs = jnp.asarray(sizes, jnp.int32)
    assert G.BF16_CUTLASS_GROUPED in fn.lower(a, bs, gs, c).as_text()
    out = np.asarray(_poisoned_call(fn, a, bs, gs, c, shape=(t, n), dtype=jnp.bfloat16), np.float64)
    _check_grouped(out, a, [jax.tree.map(lambda x: x[g], bs) for g in range(len(sizes))], sizes, c, None,
                   jnp.bfloat16, f"bf16 grouped {sizes} accumulate={accumulate} seed={seed}")


SEGMENT_SIZES = [[100, 0, 300, 128, 1], [0, 0], [1000], [600, 700]]  # ragged, empty, one, past T (clamped)


@pytest.mark.parametrize("sizes", SEGMENT_SIZES, ids=["ragged", "empty", "one", "clamped"])
@pytest.mark.parametrize("fmt", ["block", "mxfp8", "bf16"])
def test_segment_gemm(fmt, sizes):
    """The MoE wgrad grouped along K (segment_gemm, CUTLASS, segments read on the device) against float64:
    out[g] = A[:, seg g] @ B[:, seg g].T over consecutive segments of the sizes rounded up to 128 columns and
    clamped to T, zeros for an empty one; FP8 with 1x128 blocks along T on both operands, or bf16 values (decoded
    MXFP8 copies, high-precision ones: a bf16 kernel); M = 1000 (a partial tile row), N = 1064 (a partial tile
    column), T = 1152."""
    _cutlass_only()  # the grouped-along-K kernels build with the row-grouped ones (the same CUTLASS sources)
    rng, seed = _rng()
    m, n, t = 1000, 1064, 1152
    q, dec = {"block": (Float8Block((1, 128)), ()), "mxfp8": (MXFP8("e4m3"), ("rowwise",)),
              "bf16": (Identity(jnp.bfloat16), ())}[fmt]
    a = quantize(jnp.asarray(rng.standard_normal((m, t)) * rng.uniform(0.5, 4), jnp.float32), q, "rowwise",
                 decoded=dec).rowwise
    b = quantize(jnp.asarray(rng.standard_normal((n, t)) * 1e-2, jnp.float32), q, "rowwise", decoded=dec).rowwise
    assert a.decoded == (fmt == "mxfp8"), "the MXFP8 case needs decoded copies (the kernels' path)"
    seg = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(lambda a, b, seg: G.segment_gemm(a, b, seg))
    assert G.CUTLASS_KGROUPED in fn.lower(a, b, seg).as_text()
    out = np.asarray(_poisoned_call(fn, a, b, seg, shape=(len(sizes), m, n), dtype=jnp.bfloat16), np.float64)
    av, bv, start = _dequant64(a), _dequant64(b), 0
    for g, size in enumerate(sizes):
        cols = slice(start, min(start + -(-size // 128) * 128, t))
        if cols.stop <= cols.start:
            assert (out[g] == 0).all(), f"group {g} (empty segment) must be zero, seed={seed}"
        else:
            _check(out[g], av[:, cols] @ bv[:, cols].T, jnp.bfloat16,
                   f"segment gemm {fmt} {sizes} group {g} seed={seed}")
        start = max(start, cols.stop)


def _wgmma_grouped_case(recipe, sizes, accumulate):
    _hopper_only()
    qa, qb, target = WGMMA_GROUPED[recipe]
    rng, seed = _rng()
    t, k, n = 1000, 512 + 16 * (recipe != "mxfp8"), 1064  # K = 528: a partial last 128-wide K tile
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    a = quantize(x, qa, "rowwise").rowwise
    bs = [quantize(jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.01, 0.1), jnp.float32), qb,
                   "rowwise").rowwise for _ in sizes]
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.float32) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, bias, c: G.grouped_gemm(a, bs, gs, jnp.float32, bias=bias, accumulate=c,
                                                           kernel="wgmma"))
    stacked = G.stack_storages(bs)  # the weights stacked once (test_grouped passes them as a list)
    hlo = fn.lower(a, stacked, jnp.asarray(sizes, jnp.int32), bias, c).as_text()
    assert target in hlo
    out = _poisoned_call(fn, a, stacked, jnp.asarray(sizes, jnp.int32), bias, c, shape=(t, n), dtype=jnp.float32)
    _check_grouped(np.asarray(out, np.float64), a, bs, sizes, c, bias, jnp.float32,
                   f"wgmma grouped {recipe} {sizes} accumulate={accumulate} seed={seed}")
