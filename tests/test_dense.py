"""The dense op, recipes and GEMM dispatch: each GEMM reads the copies the design gives it (checked against a
float64 numpy reference of those dequantized copies), hybrid bit-identity, residuals, errors."""
import collections

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxhq
from jaxhq import recipes
from jaxhq.formats import (COLUMNWISE, MXFP8, NVFP4, ROWWISE, Float8CurrentScaling, Hybrid, Identity, init_state,
                           quantize)
from jaxhq.ops.dense import _dense_fwd
from jaxhq.ops.gemm import GemmError
from jaxhq.recipes import CustomRecipe, DenseQuantizers
from jaxhq.roles import QuantizerRole, gemm_roles
from jaxhq.ffi import primitives as P
from test_ffi_checks import spy_launches  # noqa: E402

NAMED = ["bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"]
M, K, N = 48, 256, 128  # M a multiple of 16 (RHT on the wgrad operands), not of 32 (partial MX blocks)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def states_for(qs):
    return {s: init_state(getattr(qs, s)) for s in ("input", "weight", "grad_output") if getattr(qs, s).stateful}


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def reference(x, w, b, g, qs, key, states):
    """y, dx, dw, db from the copies each GEMM is specified to read, multiplied in float64 numpy."""
    kx, kw, kdy = (jax.random.fold_in(key, i) for i in range(3))
    qx = quantize(x, qs.input, key=kx, state=states.get("input"))
    qw = quantize(w.T, qs.weight, key=kw, state=states.get("weight"))
    qdy = quantize(g, qs.grad_output, key=kdy, state=states.get("grad_output"))
    d = lambda qt, axis: f64(qt.get(axis).dequantize())  # noqa: E731
    y = d(qx, ROWWISE) @ d(qw, ROWWISE).T + f64(b)
    dx = d(qdy, ROWWISE) @ d(qw, COLUMNWISE).T
    dw = d(qx, COLUMNWISE) @ d(qdy, COLUMNWISE).T
    return y, dx, dw, f64(g).sum(0)


def run_dense(x, w, b, g, qs, key, states):
    def loss(x, w, b):
        return jnp.sum(jaxhq.dense(x, w, b, quantizers=qs, states=states, key=key) * g)

    y = jax.jit(lambda x, w, b: jaxhq.dense(x, w, b, quantizers=qs, states=states, key=key))(x, w, b)
    return (y,) + jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, b)


def rel(a, b):
    return np.linalg.norm(f64(a) - b) / np.linalg.norm(b)


HYBRID_PAIRS = {"mxfp8/nvfp4": (MXFP8(), NVFP4()), "fp8/identity": (Float8CurrentScaling(), Identity()),
                "nvfp4/mxfp8": (NVFP4(), MXFP8()), "identity/fp8": (Identity(), Float8CurrentScaling("e5m2"))}


def hybrid_qs(a, b):
    h = Hybrid(a, b)
    return DenseQuantizers(h, h, b, allow_dequantized_fallback=True)


CASES = {n: recipes.get(n).dense_quantizers("net.fc") for n in NAMED}
CASES.update({k: hybrid_qs(*v) for k, v in HYBRID_PAIRS.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_gemms_read_the_specified_copies(case):
    qs = CASES[case]
    x, w, b, g = rand(1, (M, K)), rand(2, (K, N)) * 0.1, rand(3, (N,)), rand(4, (M, N))
    key, states = jax.random.PRNGKey(5), states_for(qs)
    got = run_dense(x, w, b, g, qs, key, states)
    want = reference(x, w, b, g, qs, key, states)
    # CPU: fp32 accumulation of K <= 256 exact-format products against float64, ~1e-6 relative. GPU: fp32
    # Identity dots run as TF32 (JAX's default precision) and Hopper's FP8 tensor cores accumulate with ~14
    # significant bits, ~1e-4 relative (measured 2.5e-4 on an H100).
    tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    for name, a, r in zip(("y", "dx", "dw", "db"), got, want):
        assert a.dtype == jnp.float32
        assert rel(a, r) < tol, (case, name, rel(a, r))


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed"])
def test_fp8_gradients_are_e4m3_unless_asked(name):
    """The per-tensor FP8 recipes quantize gradients to E4M3 (docs/recipes.md: E5M2 gradients cost the small model
    3.6% / 5.6% of validation loss); grad_format="e5m2" gives the E4M3/E5M2 split. E4M3's third mantissa bit
    halves a gradient's rounding error: against the unquantized float64 products, dx and dw err about 0.63x as
    much with it (the weight's or input's E4M3 error is common to both, so not 0.5x); asked: below 0.75x."""
    default = getattr(recipes, name)().dense_quantizers("m")
    split = getattr(recipes, name)(grad_format="e5m2").dense_quantizers("m")
    assert (default.input.fmt, default.weight.fmt, default.grad_output.fmt) == ("e4m3", "e4m3", "e4m3")
    assert (split.input.fmt, split.weight.fmt, split.grad_output.fmt) == ("e4m3", "e4m3", "e5m2")
    x, w, b, g = rand(40, (M, K)), rand(41, (K, N)) * 0.1, rand(42, (N,)), rand(43, (M, N))
    exact_dx, exact_dw = f64(g) @ f64(w).T, f64(x).T @ f64(g)
    key = jax.random.PRNGKey(44)
    _, dx4, dw4, _ = run_dense(x, w, b, g, default, key, states_for(default))
    _, dx5, dw5, _ = run_dense(x, w, b, g, split, key, states_for(split))
    assert rel(dx4, exact_dx) < 0.75 * rel(dx5, exact_dx), (rel(dx4, exact_dx), rel(dx5, exact_dx))
    assert rel(dw4, exact_dw) < 0.75 * rel(dw5, exact_dw), (rel(dw4, exact_dw), rel(dw5, exact_dw))


@pytest.mark.parametrize("name", NAMED[:-1])
def test_hybrid_of_same_is_bit_identical_to_plain(name):
    plain = recipes.get(name)
    same = CustomRecipe(lambda role: Hybrid(plain.quantizer(role), plain.quantizer(role)), name="same")
    qa, qb = plain.dense_quantizers("m"), same.dense_quantizers("m")
    x, w, b, g = rand(6, (M, K), jnp.bfloat16), rand(7, (K, N), jnp.bfloat16), rand(8, (N,), jnp.bfloat16), rand(
        9, (M, N), jnp.bfloat16)
    key = jax.random.PRNGKey(0)
    for u, v in zip(run_dense(x, w, b, g, qa, key, states_for(qa)), run_dense(x, w, b, g, qb, key, states_for(qb))):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint16), np.asarray(v).view(np.uint16))


def test_bf16_recipe_is_plain_matmul_bit_for_bit():
    qs = recipes.bf16().dense_quantizers("m")
    x, w, b, g = rand(10, (2, 24, K), jnp.bfloat16), rand(11, (K, N), jnp.bfloat16), rand(12, (N,), jnp.bfloat16), \
        rand(13, (2, 24, N), jnp.bfloat16)
    ours = run_dense(x, w, b, g, qs, None, {})
    plain_y = jax.jit(lambda x, w, b: x @ w + b)(x, w, b)
    plain_g = jax.jit(jax.grad(lambda x, w, b: jnp.sum((x @ w + b) * g), (0, 1, 2)))(x, w, b)
    for u, v in zip(ours[:3], (plain_y,) + plain_g[:2]):  # y, dx, dw
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(np.asarray(u).view(np.uint16), np.asarray(v).view(np.uint16))
    # db: jaxhq sums dy in fp32 (then rounds once to bf16) where plain JAX accumulates in bf16.
    exact = f64(g).reshape(-1, N).sum(0)
    assert np.abs(f64(ours[3]) - exact).max() <= np.abs(f64(plain_g[2]) - exact).max()
    np.testing.assert_allclose(f64(ours[3]), exact, rtol=2 ** -8, atol=2 ** -8 * np.abs(exact).max())


@pytest.mark.parametrize("kernels", ["gpu", "all"])
@pytest.mark.parametrize("name", NAMED + ["fp8/identity"])
def test_float32_master_kernel_equals_its_bf16_cast(name, kernels, monkeypatch):
    """bf16 x with the float32 kernel (what the layers pass: the master weight) gives the results of the kernel
    cast to bf16 first, bit for bit (both sides quantize the same bf16 values; on the kernels, JAXHQ_KERNELS=all,
    the quantize kernel rounds the float32 as it reads it), and dw comes back in float32: the bf16 GEMM output
    cast, or where XLA drops that cast pair (its default excess precision: the plain dot of the bf16 recipe) the
    GEMM's float32 result, which rounds to it. On the kernels, where no per-tensor amax comes first, the weight's
    launch reads the float32 kernel: no bf16 copy of it is written."""
    monkeypatch.setenv("JAXHQ_KERNELS", kernels)
    qs = CASES[name] if name in CASES else recipes.get(name).dense_quantizers("m")
    x, w, b, g = rand(30, (M, K), jnp.bfloat16), rand(31, (K, N)) * 0.1, rand(32, (N,), jnp.bfloat16), \
        rand(33, (M, N), jnp.bfloat16)
    key, states = jax.random.PRNGKey(34), states_for(qs)
    ours = run_dense(x, w, b, g, qs, key, states)
    cast = run_dense(x, w.astype(jnp.bfloat16), b, g, qs, key, states)
    assert ours[2].dtype == jnp.float32 and cast[2].dtype == jnp.bfloat16
    for what, u, v in zip(("y", "dx", "dw", "db"), ours, cast):
        np.testing.assert_array_equal(np.asarray(u.astype(v.dtype).astype(jnp.float32)),
                                      np.asarray(v.astype(jnp.float32)), err_msg=f"{name} {what}")
    if kernels == "all" and name in ("fp8_block", "mxfp8", "fp8_delayed"):
        launches = spy_launches(monkeypatch)
        jax.jit(lambda x, w: jaxhq.dense(x, w, quantizers=qs, states=states)).lower(x, w)
        assert ((K, N), jnp.float32) in [(s, dt) for s, dt, _, _ in launches], launches


@pytest.mark.parametrize("kernels", ["gpu", "all"])
@pytest.mark.parametrize("name", NAMED + ["nvfp4_2d"])
def test_given_kernel_amax_equals_the_kernels_own(name, kernels, monkeypatch):
    """The float32 kernel's amax given (kernel_amax, as the train state carries it) gives the results of the op
    that reduces the kernel itself, bit for bit: the weight copies that read a per-tensor amax take it rounded to
    bf16 (the kernel's cast rounds monotonically, so that is the cast kernel's amax). On the kernels the weight's
    launch then reads the float32 kernel: no bf16 copy of it is written."""
    monkeypatch.setenv("JAXHQ_KERNELS", kernels)
    qs = recipes.get(name).dense_quantizers("m") if name != "nvfp4_2d" else \
        DenseQuantizers(NVFP4(block_2d=True), NVFP4(block_2d=True), NVFP4())
    x, w, b, g = rand(40, (M, K), jnp.bfloat16), rand(41, (K, N)) * 0.1, rand(42, (N,), jnp.bfloat16), \
        rand(43, (M, N), jnp.bfloat16)
    w = w.at[3, 7].set(0.6)  # an amax that bf16 rounds (0.6 is not a bf16 value)
    key, states = jax.random.PRNGKey(44), states_for(qs)
    amax = jnp.max(jnp.abs(w))

    def run(given):  # the amax taken inside the jitted program, as the train step does
        f = lambda x, w, b: jaxhq.dense(x, w, b, quantizers=qs, states=states, key=key,  # noqa: E731
                                        kernel_amax=jax.lax.stop_gradient(jnp.max(jnp.abs(w))) if given else None)
        return (jax.jit(f)(x, w, b),) + jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b) * g), (0, 1, 2)))(x, w, b)

    for what, u, v in zip(("y", "dx", "dw", "db"), run(True), run(False)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"{name} {what}")
    if kernels == "all" and name in ("fp8_current", "nvfp4"):
        launches = spy_launches(monkeypatch)
        jax.jit(lambda x, w: jaxhq.dense(x, w, quantizers=qs, kernel_amax=amax)).lower(x, w)
        assert ((K, N), jnp.float32) in [(s, dt) for s, dt, _, _ in launches], launches  # (bf16 without the amax)
    with pytest.raises(ValueError, match="kernel_amax must be a scalar"):
        jaxhq.dense(x, w, quantizers=qs, kernel_amax=jnp.ones((2,)))


@pytest.mark.parametrize("saved", ["default", "0", "1"])
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4", "mxfp8/nvfp4"])
def test_decoded_copies_give_the_same_results_as_codes(name, saved, monkeypatch):
    """Where the block-scaled GEMMs dequantize their operands (Hopper; the CPU handlers under JAXHQ_KERNELS=all),
    the copies a GEMM reads at once (x's and w's rowwise, both of the gradient's) may be written decoded (bf16
    values) while the ones the backward keeps stay codes; y, dx, dw and db equal those of the codes bit for bit
    (JAXHQ_DECODED=0). Per-tensor and blockwise FP8 copies are never decoded. NVFP4 16x16 weights (the nvfp4
    recipe's) make only the decoded copy, which dgrad reads transposed (ops.gemm.shares_transposed_copy): the same
    values; on the CPU handlers the same sums, so dx is equal too; on a GPU cuBLASLt reads the other layout and may
    sum in another order, so there dx is held to 2^-7 of its largest element (bf16 output: one rounding step).
    The backward's copies that the forward saves may be decoded too (ops.gemm.saved_decoded): by default x's,
    unless the weight's saved copy is its decoded forward one; with JAXHQ_DECODED_RESIDUALS=1 x's and w's; with 0
    neither. The same results every way."""
    from jaxhq.ops.gemm import decoded_copies, saved_decoded, shares_transposed_copy
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    if saved != "default":
        monkeypatch.setenv("JAXHQ_DECODED_RESIDUALS", saved)
    both = (ROWWISE, COLUMNWISE)
    assert decoded_copies(MXFP8(), both) == both and decoded_copies(NVFP4(), both) == both
    assert decoded_copies(Hybrid(MXFP8(), Float8CurrentScaling()), both) == (ROWWISE,)
    assert saved_decoded(MXFP8(), "input", MXFP8()) == (() if saved == "0" else (COLUMNWISE,))
    assert saved_decoded(MXFP8(), "weight", MXFP8()) == ((COLUMNWISE,) if saved == "1" else ())
    assert saved_decoded(NVFP4(), "input", NVFP4(block_2d=True)) == ((COLUMNWISE,) if saved == "1" else ())
    assert saved_decoded(Hybrid(MXFP8(), Float8CurrentScaling()), "weight") == ()
    qs = CASES[name]
    x, w, b, g = rand(40, (M, K), jnp.bfloat16), rand(41, (K, N)) * 0.1, rand(42, (N,), jnp.bfloat16), \
        rand(43, (M, N), jnp.bfloat16)
    key, states = jax.random.PRNGKey(44), states_for(qs)
    shared = shares_transposed_copy(qs.weight)
    launches = spy_launches(monkeypatch)
    decoded = run_dense(x, w, b, g, qs, key, states)
    asked = {(shape, which): bool(opts & P.OPT_DECODED) for shape, _, row, col in launches
             for which, (fmt, opts) in (("row", row), ("col", col)) if fmt}
    # x [M, K] and the gradient [M, N] launch as themselves, the kernel [K, N] from the other side (its rowwise
    # copy, w.T's rows, is the launch's columnwise one); a shared weight copy has no launch row side
    assert shared == (name == "nvfp4")
    kept = saved == "1"  # the backward's copies of x and w
    kept_x = kept or (saved == "default" and not shared)
    want = {((M, K), "row"): True, ((M, K), "col"): kept_x, ((K, N), "col"): True, ((K, N), "row"): kept,
            ((M, N), "row"): True, ((M, N), "col"): True}
    if shared:
        del want[((K, N), "row")]
    assert asked == want, asked
    monkeypatch.setenv("JAXHQ_DECODED", "0")
    assert not shares_transposed_copy(qs.weight) and saved_decoded(qs.input, "input") == ()
    codes = run_dense(x, w, b, g, qs, key, states)
    for what, u, v in zip(("y", "dx", "dw", "db"), decoded, codes):
        u, v = np.asarray(u.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))
        if what == "dx" and shared and jax.default_backend() != "cpu":
            np.testing.assert_allclose(u, v, rtol=0, atol=2.0 ** -7 * np.abs(v).max(), err_msg=f"{name} {what}")
        else:
            np.testing.assert_array_equal(u, v, err_msg=f"{name} {what}")


@pytest.mark.parametrize("kernels", ["gpu", "all"])
@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"])
def test_residuals_hold_no_high_precision_copy(name, kernels, monkeypatch):
    """The forward saves quantized copies only. The saved bf16 arrays allowed are decoded copies where the GEMMs
    dequantize (Hopper, or the CPU handlers under JAXHQ_KERNELS=all): NVFP4 16x16 weights' decoded copy that dgrad
    reads transposed, and x's columnwise copy that wgrad reads (ops.gemm.saved_decoded); quantized values (the
    columnwise copies', bit for bit), not x or w."""
    from jaxhq.ops.gemm import saved_decoded, shares_transposed_copy
    monkeypatch.setenv("JAXHQ_KERNELS", kernels)
    qs = recipes.get(name).dense_quantizers("m")
    x, w = rand(14, (M, K), jnp.bfloat16), rand(15, (K, N), jnp.bfloat16)
    _, res = _dense_fwd(x, w, None, {}, jax.random.PRNGKey(0), None, qs, None, None)
    saved_x, saved_w = res[0].columnwise, res[1].columnwise
    decoded = [s.data for s in (saved_x, saved_w) if s.decoded]
    leaves = [a for a in jax.tree.leaves(res) if not any(a is d for d in decoded)]
    hp = [a for a in leaves if a.dtype in (jnp.bfloat16, jnp.float32) and a.size >= min(M * K, K * N)]
    assert not hp, [(a.dtype, a.shape) for a in hp]
    assert saved_w.transposed == saved_w.decoded == shares_transposed_copy(qs.weight)
    assert saved_x.decoded == bool(saved_decoded(qs.input, "input", qs.weight))
    if jax.default_backend() == "cpu":  # (a Hopper's GEMMs dequantize whatever JAXHQ_KERNELS says)
        assert saved_x.decoded == (kernels == "all" and name in ("mxfp8", "hybrid:mxfp8:nvfp4")), name
    for s, t, q in ((saved_x, x, qs.input), (saved_w, w.T, qs.weight)):
        if s.decoded:
            want = quantize(t, q, COLUMNWISE, key=jax.random.PRNGKey(0)).columnwise
            np.testing.assert_array_equal(np.asarray(s.dequantize()), np.asarray(want.dequantize()))
    saved = [a for a in leaves if a.ndim == 2]
    assert saved, "the columnwise copies must be saved"


def test_identity_slot_saves_its_input():
    qs = DenseQuantizers(Hybrid(MXFP8(), Identity()), MXFP8(), MXFP8())
    x, w = rand(16, (M, K), jnp.bfloat16), rand(17, (K, N), jnp.bfloat16)
    _, res = _dense_fwd(x, w, None, {}, None, None, qs, None, None)
    assert any(a.dtype == jnp.bfloat16 and a.shape == (K, M) for a in jax.tree.leaves(res))


def test_factory_sees_exactly_the_roles_the_op_emits():
    seen = collections.Counter()

    def factory(role):
        seen[role] += 1
        return MXFP8()

    rec = CustomRecipe(factory)
    for name in ("a.fc1", "a.fc2", "a.fc1"):
        rec.dense_quantizers(name)
    assert set(seen) == set(gemm_roles("a.fc1").values()) | set(gemm_roles("a.fc2").values())
    assert all(v == 1 for v in seen.values()), "the factory is asked once per role"
    assert collections.Counter(r.tensor_type for r in seen) == {"input": 2, "weight": 2, "grad_output": 2}


def test_works_under_vmap_scan_remat():
    qs = recipes.mxfp8().dense_quantizers("m")
    x, w = rand(18, (3, 32, 64)), rand(19, (64, 32))
    f = lambda x, w: jaxhq.dense(x, w, quantizers=qs)  # noqa: E731
    # same quantized operands; only the fp32 summation order of a batched dot may differ
    np.testing.assert_allclose(np.asarray(jax.vmap(f, (0, None))(x, w)), np.asarray(f(x, w)), rtol=1e-6, atol=1e-5)

    def scanned(w):
        return jax.lax.scan(lambda c, xi: (c + jnp.sum(jax.checkpoint(f)(xi, w)), None), 0.0, x)[0]

    g_scan = jax.grad(scanned)(w)
    g_loop = jax.grad(lambda w: sum(jnp.sum(f(x[i], w)) for i in range(3)))(w)
    np.testing.assert_allclose(np.asarray(g_scan), np.asarray(g_loop), rtol=1e-6, atol=1e-6)


def test_delayed_scaling_states_update_forward_and_through_gradient():
    rec = recipes.fp8_delayed(history_len=8)
    qs = rec.dense_quantizers("m")
    st = states_for(qs)
    x, w, g = rand(20, (M, K)), rand(21, (K, N)), rand(22, (M, N))

    def loss(x, w, st):
        y, new = jaxhq.dense(x, w, quantizers=qs, states=st, return_state=True)
        return jnp.sum(y * g), new

    (_, new), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, st)
    assert float(new["input"]["amax_history"][0]) == float(jnp.max(jnp.abs(x)))
    assert float(new["weight"]["amax_history"][0]) == float(jnp.max(jnp.abs(w)))
    go = grads[2]["grad_output"]
    assert float(go["amax_history"][0]) == float(jnp.max(jnp.abs(g)))
    e4m3_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # the recipe's gradients are E4M3
    np.testing.assert_allclose(float(go["scale"]), e4m3_max / float(jnp.max(jnp.abs(g))), rtol=1e-6)


def test_grouped_dense_equals_per_group_dense_with_mixed_quantizers():
    sizes = (20, 0, 44, 32)
    qsets = [recipes.mxfp8().dense_quantizers("e0"), recipes.fp8_current().dense_quantizers("e1"),
             hybrid_qs(MXFP8(), NVFP4()), recipes.bf16().dense_quantizers("e3")]
    x = rand(23, (sum(sizes), 64))
    ws = rand(24, (4, 64, 32))
    g = rand(25, (sum(sizes), 32))
    loss = lambda x, ws: jnp.sum(jaxhq.grouped_dense(x, ws, jnp.asarray(sizes), quantizers=qsets) * g)  # noqa
    y = jaxhq.grouped_dense(x, ws, jnp.asarray(sizes), quantizers=qsets)
    dx, dws = jax.grad(loss, (0, 1))(x, ws)
    start = 0
    for i, s in enumerate(sizes):
        if s == 0:
            np.testing.assert_array_equal(np.asarray(dws[i]), 0)
            continue
        sl = slice(start, start + s)
        yi = jaxhq.dense(x[sl], ws[i], quantizers=qsets[i])
        dxi, dwi = jax.grad(lambda a, b: jnp.sum(jaxhq.dense(a, b, quantizers=qsets[i]) * g[sl]), (0, 1))(x[sl], ws[i])
        np.testing.assert_allclose(np.asarray(y[sl]), np.asarray(yi), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dx[sl]), np.asarray(dxi), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dws[i]), np.asarray(dwi), rtol=1e-5, atol=1e-5)
        start += s


@pytest.mark.parametrize("recipe_name", NAMED)
def test_grouped_dense_with_shared_quantizers_runs_one_vmap_bit_equal_to_the_loop(recipe_name):
    """Experts with the same quantizers run as one vmap over the stacked kernels (what expert parallelism
    splits); kernels given as a list run the per-group loop. Outputs, gradients and the delayed-scaling
    states' gradients (their next values) are the same bits; stochastic rounding keys are per group in both."""
    rec = recipes.get(recipe_name)
    sizes = jnp.asarray((40, 0, 56, 32))
    qs = [rec.dense_quantizers(f"moe.experts_{g}.fc1", "grouped_linear") for g in range(4)]
    states = None
    if qs[0].input.stateful:
        states = [{s: jax.tree.map(lambda a: a * (g + 2.0), init_state(getattr(q, s)))
                   for s in ("input", "weight", "grad_output")} for g, q in enumerate(qs)]
    x, ws, g = rand(30, (160, 64)), rand(31, (4, 64, 96)), rand(32, (160, 96))

    def loss(x, ws, st, as_list):
        kernels = [ws[i] for i in range(4)] if as_list else ws
        y = jaxhq.grouped_dense(x, kernels, sizes, quantizers=qs, key=jax.random.key(7), states=st)
        return jnp.sum(y * g)

    grads = [jax.jit(jax.value_and_grad(lambda x, w, st: loss(x, w, st, as_list), (0, 1, 2)))(x, ws, states)
             for as_list in (False, True)]
    for a, b in zip(*(jax.tree.leaves(r) for r in grads)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if recipe_name == "bf16" and jax.default_backend() == "gpu":
            # The high-precision GEMM is XLA's fp32 dot, which a GPU runs as TF32 (10-bit products), and a
            # batched dot may use another cuBLAS algorithm than G single ones: summation order differs. Seen on
            # an H100: 1.3e-4 relative at worst per element. Quantized recipes go through the FFI kernels and
            # stay bit-equal there too.
            assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b)
        else:
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- errors

def test_factory_returning_none_names_the_role():
    rec = CustomRecipe(lambda role: None if role.tensor_type == "weight" else MXFP8(), name="mine")
    with pytest.raises(TypeError, match=r"linear/weight@blk\.fc.*return Identity\(\)"):
        rec.dense_quantizers("blk.fc")
    with pytest.raises(TypeError, match="not a quantizer"):
        CustomRecipe(lambda role: "mxfp8").dense_quantizers("x")


def test_mismatched_pair_raises_naming_gemm_roles_and_formats():
    rec = CustomRecipe(lambda r: NVFP4() if r.tensor_type == "grad_output" else MXFP8(), name="mixed")
    qs = rec.dense_quantizers("blk.fc")
    x, w = rand(26, (M, K)), rand(27, (K, N))
    with pytest.raises(GemmError, match=r"dgrad GEMM.*nvfp4.*grad_output@blk\.fc.*mxfp8_e4m3.*weight@blk\.fc"):
        jax.grad(lambda x: jnp.sum(jaxhq.dense(x, w, quantizers=qs)))(x)
    ok = CustomRecipe(rec.qfactory, name="mixed", allow_dequantized_fallback=True).dense_quantizers("blk.fc")
    assert np.isfinite(float(jax.grad(lambda x: jnp.sum(jaxhq.dense(x, w, quantizers=ok)))(x).sum()))


def test_shape_errors():
    qs = recipes.mxfp8().dense_quantizers("blk.fc")
    with pytest.raises(ValueError, match=r"kernel must be 2D.*\(4, 4, 4\)"):
        jaxhq.dense(jnp.ones((4, 4)), jnp.ones((4, 4, 4)), quantizers=qs)
    with pytest.raises(ValueError, match=r"blk\.fc.*\(8, 32\).*\(64, 16\)"):
        jaxhq.dense(jnp.ones((8, 32)), jnp.ones((64, 16)), quantizers=qs)
    with pytest.raises(ValueError, match=r"input of linear/input@blk\.fc.*multiple of 16"):
        jax.grad(lambda x: jnp.sum(jaxhq.dense(x, jnp.ones((32, 16)), quantizers=recipes.nvfp4().dense_quantizers(
            "blk.fc"), key=jax.random.PRNGKey(0))))(jnp.ones((10, 32)))


def test_plan_lists_every_slot_with_both_formats():
    roles = [r for n in ("mlp.fc1", "mlp.fc2") for r in gemm_roles(n).values()]
    p = jaxhq.plan(recipes.hybrid("mxfp8", "nvfp4"), roles)
    text = str(p)
    assert text.count("mlp.fc") == 6
    f = p.formats()
    assert f[QuantizerRole("linear", "input", "mlp.fc1")] == ("mxfp8_e4m3", "nvfp4_rht")
    assert f[QuantizerRole("linear", "weight", "mlp.fc2")] == ("mxfp8_e4m3", "nvfp4_2d")
    assert f[QuantizerRole("linear", "grad_output", "mlp.fc2")] == ("nvfp4_rht_sr", "nvfp4_rht_sr")
