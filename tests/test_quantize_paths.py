"""The per-format choice between the FFI kernel and XLA's fusion of the reference (JAXHQ_QUANTIZE_PATH), on the
default backend's kernels (JAXHQ_KERNELS=all: the CPU handlers in CI; scripts/gpu_check.sh runs the file on a GPU
too): the compiled program holds exactly the custom calls the choice names, the copies are the same bits either
way (kernels equal the reference, NaN amaxes and scale_invs the canonical NaN), bad specs name what is wrong, and
jaxhq.plan shows the path of each copy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhq
import jaxhq.ffi
from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Hybrid, quantize
from jaxhq.formats.quantize import DEFAULT_PATHS, copy_path, quantize_paths

pytestmark = pytest.mark.skipif(not jaxhq.ffi.available("cpu"), reason="the FFI extension is not built")


def _hlo_and_copies(q, x):
    fn = jax.jit(lambda x: quantize(x, q))
    qt = fn(x)
    return fn.lower(x).as_text(), qt


def _same_bits(got, want, what):
    """The same bytes, except that a float32 scale_inv of a NaN amax is any NaN on XLA's side (its bits depend on
    how XLA compiled the reciprocal: 0x7FC00000 or 0x7FFFFFFF on a GPU) and the canonical NaN on the kernel's."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.dtype == np.float32 and want.dtype == np.float32 and np.isnan(want).any():
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
        assert (got[nan].view(np.uint32) == np.float32(np.nan).view(np.uint32)).all(), what
        got, want = got[~nan], want[~nan]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


@pytest.fixture
def kernels_everywhere(monkeypatch):
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    return monkeypatch


def test_paths_spec(monkeypatch):
    monkeypatch.delenv("JAXHQ_QUANTIZE_PATH", raising=False)
    monkeypatch.setenv("JAXHQ_KERNELS", "gpu")
    assert quantize_paths() == DEFAULT_PATHS
    monkeypatch.setenv("JAXHQ_KERNELS", "all")  # the tests' mode: every family on its kernel
    assert set(quantize_paths().values()) == {"kernel"}
    monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", "all=xla,mxfp8=kernel")
    p = quantize_paths()
    assert p["mxfp8"] == "kernel" and p["fp8"] == "xla" and p["amax"] == "xla"
    for bad in ("mxfp9=xla", "fp8=gpu", "fp8"):
        monkeypatch.setenv("JAXHQ_QUANTIZE_PATH", bad)
        with pytest.raises(ValueError, match=f"JAXHQ_QUANTIZE_PATH: '{bad}'"):
            quantize_paths()


def test_hybrid_sides_take_their_own_path(kernels_everywhere):
    x = jax.random.normal(jax.random.key(0), (256, 384), jnp.float32).astype(jnp.bfloat16)
    q = Hybrid(MXFP8(), Float8Block())
    results = {}
    for spec, calls in (("all=kernel", 1), ("mxfp8=xla", 1), ("fp8_block=xla", 1), ("all=xla", 0)):
        kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", spec)
        hlo, qt = _hlo_and_copies(q, x)
        assert hlo.count("jaxhq_quantize") == calls, spec
        results[spec] = qt
        assert copy_path(q, "rowwise", "cpu") == ("xla" if spec in ("mxfp8=xla", "all=xla") else "kernel")
    # kernels equal the reference bit for bit, so every mix of paths gives the same copies
    for spec, qt in results.items():
        for axis in ("rowwise", "columnwise"):
            for f in ("data", "scale_inv"):
                a, b = getattr(qt.get(axis), f), getattr(results["all=xla"].get(axis), f)
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                              err_msg=f"{spec} {axis}.{f}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("q", [Float8CurrentScaling(), NVFP4(block_2d=True),
                               Hybrid(Float8CurrentScaling(), NVFP4())], ids=lambda q: q.label)
def test_amax_path(kernels_everywhere, q, dtype):
    """The amax from the jaxhq_amax kernel or from XLA's reduction (the integer max of the |x| bit patterns, the
    kernel given its NaN as it comes): the same copies bit for bit, a canonical NaN amax when x holds a NaN."""
    x = jax.random.normal(jax.random.key(1), (128, 320), jnp.float32).astype(dtype)
    x = x.at[3, 5].set(-1e4)  # the amax
    for xi in (x, x.at[0, 0].set(jnp.nan), x.at[9, 1].set(-jnp.inf)):
        out = {}
        for spec, amax_calls in (("amax=kernel", 1), ("amax=xla", 0)):
            kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", spec)
            hlo, qt = _hlo_and_copies(q, xi)
            assert hlo.count("jaxhq_amax") == amax_calls and hlo.count("jaxhq_quantize") == 1, spec
            out[spec] = qt
        for axis in ("rowwise", "columnwise"):
            a, b = out["amax=kernel"].get(axis), out["amax=xla"].get(axis)
            for f in ("data", "scale_inv", "amax"):
                _same_bits(getattr(a, f), getattr(b, f), f"{axis}.{f}")
            expect = np.nan if jnp.isnan(xi).any() else np.inf if jnp.isinf(xi).any() else float(dtype(1e4))
            np.testing.assert_array_equal(np.asarray(b.amax), np.float32(expect))
            if np.isnan(expect):  # the canonical NaN, as formats.base.abs_max gives it
                assert np.asarray(b.amax).view(np.uint32) == np.float32(np.nan).view(np.uint32)


def test_plan_shows_the_path(kernels_everywhere):
    """The path of each copy, and which kernel-made copies are decoded (the forward's rowwise one, and by default
    the input's saved columnwise one: the CPU handlers dequantize, as Hopper's GEMMs do)."""
    kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", "nvfp4=xla")
    role = jaxhq.QuantizerRole("linear", "input", "layers_0.fc1")
    text = str(jaxhq.plan("hybrid:mxfp8:nvfp4", [role]))
    assert "path (row|col)" in text and "kernel+decoded|xla" in text
    expert = jaxhq.QuantizerRole("grouped_linear", "input", "moe.experts_0.fc1")  # an MoE expert's: the same
    assert "kernel+decoded|xla" in str(jaxhq.plan("hybrid:mxfp8:nvfp4", [expert]))
    weight = jaxhq.QuantizerRole("linear", "weight", "layers_0.fc1")
    path = lambda r: jaxhq.plan("mxfp8", [r]).rows[0].path  # noqa: E731
    assert path(role) == "kernel+decoded|kernel+decoded" and path(weight) == "kernel+decoded|kernel"  # the default
    kernels_everywhere.setenv("JAXHQ_DECODED_RESIDUALS", "0")
    assert path(role) == "kernel+decoded|kernel"
    kernels_everywhere.setenv("JAXHQ_DECODED_RESIDUALS", "1")  # the backward's copies saved decoded too
    assert path(role) == path(weight) == "kernel+decoded|kernel+decoded"
    kernels_everywhere.setenv("JAXHQ_DECODED", "0")
    assert "kernel|xla" in str(jaxhq.plan("hybrid:mxfp8:nvfp4", [role]))
    assert path(role) == path(weight) == "kernel|kernel"


def test_plan_shows_a_weight_copy_read_transposed(kernels_everywhere):
    """NVFP4 16x16 weights on a decoding GEMM platform: the columnwise copy is the decoded rowwise one read
    transposed; with JAXHQ_TRANSPOSED_COPY=0 it is a kernel copy of its own again."""
    role = jaxhq.QuantizerRole("linear", "weight", "layers_0.fc1")
    assert "kernel+decoded|rowwise.T" in str(jaxhq.plan("nvfp4", [role]))
    assert "rowwise.T" not in str(jaxhq.plan("hybrid:mxfp8:nvfp4", [role]))  # the two copies' formats differ
    kernels_everywhere.setenv("JAXHQ_TRANSPOSED_COPY", "0")
    assert "kernel+decoded|kernel" in str(jaxhq.plan("nvfp4", [role]))


def test_plan_shows_the_activation_launch(kernels_everywhere):
    """fc1 of an MLP whose activation it owns (no bias): its grad_output copies come out of the activation
    gradient's launch for the default's families (FP8 blockwise, delayed scaling) where the gradient holds
    ACT_GRAD_MIN_ELEMENTS elements or more, not for MXFP8 (XLA's gradient by default) or current scaling (an amax
    first); with a bias, or fewer tokens, XLA computes the gradient."""
    from jaxhq.formats.quantize import ACT_GRAD_MIN_ELEMENTS
    from jaxhq.layers import LayerNormMLP
    kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", f"act_grad={DEFAULT_PATHS['act_grad']}")
    tokens = ACT_GRAD_MIN_ELEMENTS // (2 * 4096)  # fc1's gradient: 2 x 4096 elements a token
    x = jnp.ones((1, tokens, 256), jnp.bfloat16)

    def fc1_grad_path(recipe, bias=False, x=x):
        mlp = LayerNormMLP(d_ff=4096, activation="swiglu", use_bias=bias, recipe=jaxhq.recipes.get(recipe))
        rows = jaxhq.plan(recipe, mlp, x).rows
        return {(r.role.name, r.role.tensor_type): r.path for r in rows}

    assert fc1_grad_path("fp8_block", x=x[:, 1:])[("fc1", "grad_output")] == "kernel|kernel"

    for recipe, want in (("fp8_block", "kernel+act|kernel+act"), ("fp8_delayed", "kernel+act|kernel+act"),
                         ("mxfp8", "kernel+decoded|kernel+decoded"), ("fp8_current", "kernel|kernel")):
        paths = fc1_grad_path(recipe)
        assert paths[("fc1", "grad_output")] == want, recipe
        assert "act" not in paths[("fc2", "grad_output")] and "act" not in paths[("fc1", "input")]
    assert fc1_grad_path("fp8_block", bias=True)[("fc1", "grad_output")] == "kernel|kernel"


def test_delayed_scaling_takes_its_amax_from_the_quantize_kernel(kernels_everywhere):
    """Delayed scaling knows its scale beforehand: the quantize kernel also writes max |x| from the values it
    reads, so the program has no amax pass of its own (no reduce over x, no jaxhq_amax), and the recorded amax
    and the next state are the reference's bit for bit, NaN included."""
    from jaxhq.formats import Float8DelayedScaling, init_state, update_state
    q = Float8DelayedScaling(history_len=4)
    x = jax.random.normal(jax.random.key(2), (256, 384), jnp.float32).astype(jnp.bfloat16) * 3
    st = init_state(q)
    for xi in (x, x.at[7, 9].set(jnp.nan)):
        out = {}
        for spec in ("all=kernel", "all=xla"):
            kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", spec)
            fn = jax.jit(lambda x, st: (lambda qt: (qt, update_state(q, st, qt)))(quantize(x, q, state=st)))
            hlo = fn.lower(xi, st).compile().as_text()
            if spec == "all=kernel":
                assert hlo.count('custom_call_target="jaxhq_quantize"') == 1 and "jaxhq_amax" not in hlo
                assert not [ln for ln in hlo.splitlines() if " reduce(" in ln and "dimensions={0,1}" in ln], spec
            out[spec] = fn(xi, st)
        (qa, sa), (qb, sb) = out["all=kernel"], out["all=xla"]
        for a, b in ((qa.rowwise.amax, qb.rowwise.amax), (qa.columnwise.amax, qb.columnwise.amax),
                     (qa.rowwise.data, qb.rowwise.data), (qa.columnwise.data, qb.columnwise.data),
                     (sa["amax_history"], sb["amax_history"]), (sa["scale"], sb["scale"])):
            np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                          np.asarray(b).reshape(-1).view(np.uint8))
        assert bool(jnp.isnan(qa.rowwise.amax)) == bool(jnp.isnan(xi).any())


@pytest.mark.parametrize("q", [Float8CurrentScaling(), Float8CurrentScaling("e5m2", power_2_scale=True),
                               Float8CurrentScaling(amax_epsilon=2.0),
                               Hybrid(Float8CurrentScaling(), Float8CurrentScaling("e5m2", amax_epsilon=2.0))],
                         ids=lambda q: q.label)
def test_current_scaling_scale_is_computed_in_the_kernel(kernels_everywhere, q):
    """The quantize kernel takes the amax and computes scale and scale_inv itself (one launch after the amax,
    no small XLA kernels around it), equal to fp8.scale_from_amax bit for bit: powers of 2, an eps that
    matters (amaxes below it), a NaN amax, and a hybrid whose sides' eps differ (one side's scale from jnp)."""
    x = jax.random.normal(jax.random.key(3), (256, 384), jnp.float32).astype(jnp.bfloat16)
    for xi in (x, x * 1e-3, x.at[1, 2].set(jnp.nan)):
        out = {}
        for spec in ("all=kernel", "all=xla"):
            kernels_everywhere.setenv("JAXHQ_QUANTIZE_PATH", spec)
            hlo, out[spec] = _hlo_and_copies(q, xi)
            if spec == "all=kernel":
                compiled = jax.jit(lambda x: quantize(x, q)).lower(xi).compile().as_text()
                assert hlo.count("jaxhq_quantize") == 1
                same_eps = not isinstance(q, Hybrid)
                assert (" divide(" not in compiled) == same_eps, compiled
        for axis in ("rowwise", "columnwise"):
            ka, xa = out["all=kernel"].get(axis), out["all=xla"].get(axis)
            # FP8 codes as values: NaN equals NaN whatever its code (E5M2 has three; XLA and the kernels pick
            # different ones), everything else exactly
            np.testing.assert_array_equal(np.asarray(ka.data, np.float32), np.asarray(xa.data, np.float32))
            for f in ("scale_inv", "amax"):
                _same_bits(getattr(ka, f), getattr(xa, f), f"{axis}.{f}")
