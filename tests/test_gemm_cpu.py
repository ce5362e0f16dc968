"""The CPU handlers of the GEMM targets (the same custom calls as the GPU kernels, for the CPU suite and the
sharding tests) against a float64 GEMM of the dequantized operands: every recipe's forward, dgrad and wgrad
operand pairs (test_gemm_gpu's cases), bias and accumulate, bf16 output, the ragged grouped form.

Bound, per element: the handler decodes exactly, sums in double and rounds once (fp32), then adds bias and
`c` in fp32 and rounds to the output dtype; so |out - ref| <= 4 u (|A| |B|^T + |bias| + |c|) with u = 2^-24
(fp32) or 2^-8 (bf16). A wrong scale, layout or index gives errors of order |ref|.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhq.ffi import gemm as G
from test_gemm_gpu import (KERNEL, RECIPES, _cases, _dequant64, _near_unquantized, _operands, _reference,
                           _tiny_nvfp4_operands, _transposed_weight_operands)

U = {jnp.float32: 2.0 ** -24, jnp.bfloat16: 2.0 ** -8}


@pytest.fixture(autouse=True)
def _cpu_handlers():
    if not G._registered("cpu"):
        pytest.skip("the FFI extension is not built")


def _check(out, ref, mag, dtype, what):
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    bound = 4 * U[dtype] * mag + 1e-300
    worst = float(np.max(np.abs(out - ref) / bound))
    assert worst <= 1, f"{what}: max |out - ref| / bound = {worst:.3g}"


def _mag(a, b):
    return np.abs(_dequant64(a)) @ np.abs(_dequant64(b)).T


@pytest.mark.parametrize("recipe,gemm,m", [c for c in _cases() if c[2] in (17, 128) or c[0] == "mxfp8" and c[2] == 1000])
def test_cpu_gemm_matches_float64(recipe, gemm, m):
    a, b, seed = _operands(recipe, gemm, m)
    out = jax.jit(lambda a, b: KERNEL[recipe](a, b, jnp.float32))(a, b)
    assert "jaxhq_gemm" in jax.jit(lambda a, b: KERNEL[recipe](a, b, jnp.float32)).lower(a, b).as_text()
    _check(out, _reference(a, b), _mag(a, b), jnp.float32, f"{recipe} {gemm} M={m} seed={seed}")


@pytest.mark.parametrize("gemm", ["forward", "wgrad"])
def test_cpu_nvfp4_gemm_of_a_tiny_tensor(gemm):
    """The handler's alpha caps the global encode scale as the quantizer does (it overflowed to inf: NaN or 0 out)."""
    a, b, exact, seed = _tiny_nvfp4_operands(gemm)
    out = jax.jit(lambda a, b: KERNEL["nvfp4"](a, b, jnp.float32))(a, b)
    _check(out, _reference(a, b), _mag(a, b), jnp.float32, f"tiny nvfp4 {gemm} seed={seed}")
    _near_unquantized(out, exact, f"tiny nvfp4 {gemm} seed={seed}")


@pytest.mark.parametrize("m", [17, 64])
def test_cpu_dgrad_reads_a_transposed_decoded_weight(m):
    """The weight's decoded rowwise copy read transposed (b_kn) holds the columnwise copy's values, and the handler
    gives the dgrad GEMM of the columnwise codes bit for bit (the same values summed in the same order), within
    the float64 bound."""
    a, view, col, _, seed = _transposed_weight_operands(m)
    np.testing.assert_array_equal(np.asarray(view.dequantize()), np.asarray(col.dequantize()))
    run = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.float32))
    assert "b_kn = 1" in run.lower(a, view).as_text()
    out = run(a, view)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run(a, col)))
    _check(out, _reference(a, col), _mag(a, col), jnp.float32, f"nvfp4 dgrad transposed weight M={m} seed={seed}")


def test_cpu_transposed_operand_errors():
    """A transposed copy as A, a transposed B of codes, or a transposed FP8 operand is refused with the reason (the
    dispatch table then runs the dequantized reference, which reads any copy)."""
    a, view, _, _, _ = _transposed_weight_operands(17)
    _, w_codes, _ = _operands("nvfp4", "forward", 17)  # the weight's rowwise codes [N, K]
    with pytest.raises(G.GemmUnsupported, match="A is a transposed copy"):
        G.blockscaled_gemm(view, a, jnp.float32)
    with pytest.raises(G.GemmUnsupported, match="transposed copy of codes"):
        G.blockscaled_gemm(a, w_codes.transpose_of(), jnp.float32)
    with pytest.raises(G.GemmUnsupported, match="FP8 operands"):
        G.fp8_gemm(view, view, jnp.float32)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cpu_bias_and_accumulate(recipe, dtype):
    """out = c + A @ B.T + bias with c random: an element the handler does not write keeps c and fails."""
    a, b, seed = _operands(recipe, "forward", 17)
    rng = np.random.default_rng(seed)
    ref = _reference(a, b)
    scale = np.abs(ref).mean()
    c = jnp.asarray(rng.standard_normal(ref.shape) * scale, dtype)
    bias = jnp.asarray(rng.standard_normal(ref.shape[1]) * scale, dtype)
    out = jax.jit(lambda a, b, c, bias: KERNEL[recipe](a, b, dtype, bias=bias, accumulate=c))(a, b, c, bias)
    c64, b64 = np.asarray(c, np.float64), np.asarray(bias, np.float64)[None, :]
    _check(out, ref + c64 + b64, _mag(a, b) + np.abs(c64) + np.abs(b64), dtype, f"{recipe} bias+accumulate")


@pytest.mark.parametrize("recipe", ["fp8", "fp8_block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate"])
def test_cpu_grouped(recipe, accumulate):
    """Ragged groups [5, 0, 70, 20] of T = 100 rows: 5 rows past the groups are zero (or keep `c`); the weights
    as a list or stacked once."""
    from jaxhq.formats import quantize
    qx, qw, _ = RECIPES[recipe]
    rng = np.random.default_rng(5)
    t, k, n, sizes = 100, 256, 64, [5, 0, 70, 20]
    a = quantize(jnp.asarray(rng.standard_normal((t, k)), jnp.float32), qx, "rowwise").rowwise
    bs = [quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32), qw, "rowwise").rowwise
          for _ in sizes]
    bias = jnp.asarray(rng.standard_normal((len(sizes), n)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((t, n)), jnp.float32) if accumulate else None
    fn = jax.jit(lambda a, bs, gs, bias, c: G.grouped_gemm(a, bs, gs, jnp.float32, bias=bias, accumulate=c))
    out = np.asarray(fn(a, bs, jnp.asarray(sizes, jnp.int32), bias, c), np.float64)
    # the weights stacked once (one Storage with a group axis) make the same call: the same bits
    stacked = np.asarray(fn(a, G.stack_storages(bs), jnp.asarray(sizes, jnp.int32), bias, c), np.float64)
    np.testing.assert_array_equal(stacked, out)
    av = _dequant64(a)
    ref = np.zeros((t, n)) if c is None else np.asarray(c, np.float64).copy()
    mag = np.abs(ref)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        bv = _dequant64(bs[g])
        ref[rows] += av[rows] @ bv.T + np.asarray(bias[g], np.float64)[None, :]
        mag[rows] += np.abs(av[rows]) @ np.abs(bv).T + np.abs(np.asarray(bias[g], np.float64))[None, :]
        start += size
    _check(out, ref, mag, jnp.float32, f"grouped {recipe} accumulate={accumulate}")
    if not accumulate:
        assert (out[start:] == 0).all(), "rows past the groups must be zero"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_cpu_grouped_reads_decoded_operands(fmt):
    """Decoded copies (bf16 values, as the quantize launch writes them where the GEMMs dequantize) as A and as the
    stacked weights give the codes' grouped GEMM bit for bit: the same values summed in the same order; a decoded
    operand is refused by the wgmma kernel, which reads codes."""
    from jaxhq.ffi.dispatch import quantize_copies
    from jaxhq.formats import quantize
    q = RECIPES[fmt][0]
    rng = np.random.default_rng(6)
    t, k, n, sizes = 100, 256, 64, jnp.asarray([5, 0, 70, 20], jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32) for _ in range(4)]
    dec = lambda v: quantize_copies(v, q, ("rowwise",), decoded=("rowwise",))["rowwise"]  # noqa: E731
    a, bs = dec(x), G.stack_storages([dec(w) for w in ws])
    assert a.decoded and bs.decoded and a.data.dtype == bs.data.dtype == jnp.bfloat16
    a_codes = quantize(x, q, "rowwise").rowwise
    bs_codes = G.stack_storages([quantize(w, q, "rowwise").rowwise for w in ws])
    fn = jax.jit(lambda a, bs: G.grouped_gemm(a, bs, sizes, jnp.float32))
    want = np.asarray(fn(a_codes, bs_codes))
    for got, what in ((fn(a, bs), "both"), (fn(a, bs_codes), "A"), (fn(a_codes, bs), "B")):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{fmt}: decoded {what}")
    with pytest.raises(G.GemmUnsupported, match="reads codes"):
        G.grouped_gemm(a, bs, sizes, jnp.float32, kernel="wgmma")


def test_stack_storages_rejects_mixed_groups():
    """Grouped weights of different formats (or none) are an error naming the cause, not a silent stack."""
    from jaxhq.formats import quantize
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.float32)
    per_tensor = quantize(w, RECIPES["fp8"][1], "rowwise").rowwise
    blockwise = quantize(w, RECIPES["fp8_block"][1], "rowwise").rowwise
    with pytest.raises(G.GemmUnsupported, match="differ in format or shape"):
        G.stack_storages([per_tensor, blockwise])
    with pytest.raises(G.GemmUnsupported, match="no groups"):
        G.stack_storages([])
    with pytest.raises(G.GemmUnsupported, match="need data \\[G, N"):
        G.grouped_gemm(per_tensor, per_tensor, jnp.ones((1,), jnp.int32))


def test_cpu_handler_rejects_a_mismatched_call():
    """A call whose buffers do not match (here B's scales for another K) is an error naming the operand."""
    a, b, _ = _operands("fp8_block", "forward", 17)
    import jax.ffi
    call = jax.ffi.ffi_call(G.FP8_TARGET, (jax.ShapeDtypeStruct((17, b.data.shape[0]), jnp.float32),
                                           jax.ShapeDtypeStruct((256,), jnp.uint8)))  # + the workspace
    empty = jnp.zeros((0,), jnp.float32)
    with pytest.raises(Exception, match="B scales .* do not match its data"):
        jax.block_until_ready(call(a.data, a.scale_inv, b.data, b.scale_inv[:, :1], empty, empty,
                                   mode_a=np.int32(1), mode_b=np.int32(2), layout=np.int32(0), pad=np.int32(4),
                                   accumulate=np.int32(0), fast_accum=np.int32(0)))


def test_fp8_fast_accumulation_in_forward_and_dgrad(monkeypatch):
    """The per-tensor FP8 forward and dgrad GEMMs ask for fast accumulation (ops.gemm.FAST_ACCUM), wgrad does not;
    JAXHQ_FP8_FAST_ACCUM="" turns it off."""
    import re
    from jaxhq import recipes
    from jaxhq.ops import dense
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    qs = recipes.get("fp8_current").dense_quantizers("layer")
    x, w = jnp.ones((64, 128)), jnp.ones((128, 256))

    def flags():
        f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(dense(x, w, quantizers=qs) ** 2), argnums=(0, 1)))
        text = f.lower(x, w).as_text()
        calls = [ln for ln in text.splitlines() if "jaxhq_gemm_fp8" in ln]
        return sorted(int(re.search(r"fast_accum = (\d)", ln).group(1)) for ln in calls)

    assert flags() == [0, 1, 1]  # forward and dgrad fast; wgrad promoted
    monkeypatch.setenv("JAXHQ_FP8_FAST_ACCUM", "")
    assert flags() == [0, 0, 0]


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_block_gemms_take_the_quantize_launch_scales_as_they_lie(monkeypatch, recipe):
    """fp8_block's and mxfp8's forward, dgrad and wgrad: every 1x128 scale operand of jaxhq_gemm_fp8, and every MXFP8
    one of jaxhq_gemm_dq (codes or decoded), is an output of a jaxhq_quantize launch itself in the optimized program
    (the swap in ffi.primitives.quantize and the GEMM's own cancel; no transpose, copy or layout change between
    them, only the CPU backend's bitcast of E8M0 to uint8): no re-layout kernel per GEMM."""
    import re
    from jaxhq import recipes
    from jaxhq.ops import dense
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    qs = recipes.get(recipe).dense_quantizers("layer")
    x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 384), jnp.bfloat16)
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(dense(x, w, quantizers=qs).astype(jnp.float32) ** 2),
                                   argnums=(0, 1)))
    text = f.lower(x, w).compile().as_text()
    quantized = set()  # get-tuple-elements of the quantize launches, and bitcasts of them
    launches = {m.group(1) for m in re.finditer(r"(%?[\w.-]+) = \(.*custom_call_target=\"jaxhq_quantize\"", text)}
    for m in re.finditer(r"(%?[\w.-]+) = \S+ get-tuple-element\((%?[\w.-]+)\)", text):
        if m.group(2) in launches:
            quantized.add(m.group(1))
    for m in re.finditer(r"(%?[\w.-]+) = u8\S+ (?:bitcast-convert\((%?[\w.-]+)\)|fusion\((%?[\w.-]+)\), kind=kLoop, "
                         r"calls=%?wrapped_bitcast-convert_computation[\w.]*,)", text):
        if (m.group(2) or m.group(3)) in quantized:
            quantized.add(m.group(1))
    target = "jaxhq_gemm_fp8" if recipe == "fp8_block" else "jaxhq_gemm_dq"
    gemms = [ln for ln in text.splitlines() if f'custom_call_target="{target}"' in ln]
    assert len(gemms) == 3
    for ln in gemms:
        ops = re.search(r"custom-call\(([^)]*)\)", ln).group(1).split(", ")
        ops = [o.split("*/")[-1] for o in ops]
        if recipe == "mxfp8":  # (a, a scales, a amax, b, b scales, ...), every scale read where the launch wrote it
            assert "rows_inner = 1" in ln and {ops[1], ops[4]} <= quantized, ln
            continue
        modes = (int(re.search(r"mode_a = (\d)", ln).group(1)), int(re.search(r"mode_b = (\d)", ln).group(1)))
        for scale, mode in ((ops[1], modes[0]), (ops[3], modes[1])):
            assert mode != G.MODE_VEC128 or scale in quantized, ln
