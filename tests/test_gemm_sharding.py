"""The FFI GEMMs under a mesh, on their CPU handlers (JAXHQ_KERNELS=all) on 8 CPU devices.

Each device multiplies its own shards: rows of A (tokens) and rows of B (a column-parallel weight) stay split,
a split contraction (row-parallel, wgrad over tokens) is reduced with one all-reduce, or a reduce-scatter where
the output is wanted split; the compiled program holds no all-gather, and the result equals the unsharded
call up to the summation order of the split contraction. Runs in test_sharding_launch.py's subprocess when
this process has fewer than 8 devices.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxhq import recipes
from jaxhq.ffi import gemm as G
from jaxhq.ffi import partitioning
from jaxhq.formats import quantize
from jaxhq.sharding import make_mesh
from jaxhq.sharding.hlo import collectives

table = importlib.import_module("jaxhq.ops.gemm")  # the module (jaxhq.ops re-exports the function `gemm`)


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices; test_sharding_launch.py runs this file that way")
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    if not G._registered("cpu"):
        pytest.skip("the FFI extension is not built")


M_, K_, N_ = 256, 1024, 512  # shards of >= 128 along every dim: whole blocks of every format (128x128 too)
# name: (spec of x [M, K], spec of w [N, K], constraint on the output, the reduction the program must hold)
LAYOUTS = {
    "tokens": (P(("data", "tensor"), None), P(None, None), None, None),
    "column": (P("data", None), P("tensor", None), None, None),
    "row": (P("data", "tensor"), P(None, "tensor"), None, "all-reduce"),
    "row_scattered": (P("data", "tensor"), P(None, "tensor"), P(("data", "tensor"), None), "reduce-scatter"),
    "wgrad": (P(None, ("data", "tensor")), P(None, ("data", "tensor")), None, "all-reduce"),
}
RECIPES = ["fp8_current", "fp8_block", "mxfp8", "nvfp4"]


def _bound(a, b):
    """|difference| of two fp32 summation orders of A @ B.T, per element: each is within K u ||a_i|| ||b_j||
    of the exact product (Higham; u = 2^-24, split partial sums included); 4x that for both and margin."""
    a, b = np.asarray(a.dequantize(), np.float64), np.asarray(b.dequantize(), np.float64)
    return 4 * a.shape[1] * 2.0 ** -24 * np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)) + 1e-30


def _operands(recipe, seed):
    qs = recipes.get(recipe).dense_quantizers("layers_0.fc")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M_, K_)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N_, K_)) / K_ ** 0.5, jnp.float32)
    return qs, x, w


def _compile(fn, mesh, specs, args, out_spec=None):
    def body(*a):
        a = [jax.lax.with_sharding_constraint(v, NamedSharding(mesh, s)) for v, s in zip(a, specs)]
        y = fn(*a)
        return y if out_spec is None else jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out_spec))
    placed = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(args, specs)]
    compiled = jax.jit(body).lower(*placed).compile()
    return compiled(*placed), compiled.as_text()


def _check_collectives(hlo, reduction, what):
    gathers = collectives(hlo, "all-gather")
    assert not gathers, f"{what}: all-gathers in the program: {gathers}"
    big = [c for kind in ("all-reduce", "reduce-scatter") for c in collectives(hlo, kind) if len(c.shape) == 2]
    if reduction is None:
        assert not big, f"{what}: no reduction expected, found {big}"
    else:
        assert big and all(c.kind == reduction for c in big), f"{what}: expected one {reduction}, found {big}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_gemm_equals_unsharded_without_gathers(recipe, layout):
    xs, ws, out_spec, reduction = LAYOUTS[layout]
    mesh = make_mesh(data=2, tensor=4)
    qs, x, w = _operands(recipe, seed=hash((recipe, layout)) % 2 ** 31)

    def fn(x, w):
        a = quantize(x, qs.input, ("rowwise",)).rowwise
        b = quantize(w, qs.weight, ("rowwise",)).rowwise
        return table.gemm(a, b, jnp.float32)

    got, hlo = _compile(fn, mesh, (xs, ws), (x, w), out_spec)
    assert "jaxhq_gemm" in hlo, "the GEMM did not run the FFI target"
    _check_collectives(hlo, reduction, f"{recipe} {layout}")
    ref = jax.jit(fn)(x, w)  # one device: the same kernel on the whole operands
    a = quantize(x, qs.input, ("rowwise",)).rowwise
    b = quantize(w, qs.weight, ("rowwise",)).rowwise
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    if reduction is None:  # no split contraction: the same kernel call on the same rows, bit for bit
        assert np.array_equal(np.asarray(got), np.asarray(ref)), f"{recipe} {layout}: max diff {diff.max():.3g}"
    else:
        bound = _bound(a, b)
        assert np.all(diff <= bound), f"{recipe} {layout}: max diff/bound {np.max(diff / bound):.3g}"


@pytest.mark.parametrize("layout", ["column", "row"])
def test_bias_and_accumulate_are_added_once(layout):
    """bias [N] and accumulate [M, N] go with the output's shards; with a split contraction they are added
    after the reduction (once), not on every device's partial sum."""
    xs, ws, _, reduction = LAYOUTS[layout]
    mesh = make_mesh(data=2, tensor=4)
    qs, x, w = _operands("fp8_current", seed=7)
    rng = np.random.default_rng(8)
    bias = jnp.asarray(rng.standard_normal(N_), jnp.float32)
    acc = jnp.asarray(rng.standard_normal((M_, N_)), jnp.float32)
    n_axes = ws[0]

    def fn(x, w, bias, acc):
        a = quantize(x, qs.input, ("rowwise",)).rowwise
        b = quantize(w, qs.weight, ("rowwise",)).rowwise
        return partitioning.gemm(G.fp8_gemm, a, b, jnp.float32, bias=bias, accumulate=acc)

    specs = (xs, ws, P(n_axes), P(xs[0], n_axes))
    got, hlo = _compile(fn, mesh, specs, (x, w, bias, acc))
    _check_collectives(hlo, reduction, f"bias+accumulate {layout}")
    ref = jax.jit(fn)(x, w, bias, acc)
    a, b = (quantize(v, q, ("rowwise",)).rowwise for v, q in ((x, qs.input), (w, qs.weight)))
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    bound = _bound(a, b) + 4 * 2.0 ** -24 * np.abs(np.asarray(ref, np.float64))  # + the final roundings
    assert np.all(diff <= bound), f"{layout}: max diff/bound {np.max(diff / bound):.3g}"


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "nvfp4"])
def test_vmapped_experts_stay_on_their_devices(recipe):
    """A vmapped GEMM (the experts of a grouped dense) with the expert dim split: each device multiplies only
    its experts, tokens split on `data` stay split, nothing is gathered."""
    mesh = make_mesh(expert=4, data=2)
    qs = recipes.get(recipe).dense_quantizers("layers_0.moe")
    rng = np.random.default_rng(3)
    e = 4
    xs = jnp.asarray(rng.standard_normal((e, M_, K_)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((e, N_, K_)) / K_ ** 0.5, jnp.float32)

    def one(x, w):
        a = quantize(x, qs.input, ("rowwise",)).rowwise
        b = quantize(w, qs.weight, ("rowwise",)).rowwise
        return table.gemm(a, b, jnp.float32)

    fn = jax.vmap(one)
    got, hlo = _compile(fn, mesh, (P("expert", "data", None), P("expert", None, None)), (xs, ws))
    assert "jaxhq_gemm" in hlo
    _check_collectives(hlo, None, f"experts {recipe}")
    ref = jax.jit(fn)(xs, ws)
    assert np.array_equal(np.asarray(got), np.asarray(ref)), f"experts {recipe}: sharded != unsharded"


@pytest.mark.parametrize("layout,reduction", [("tokens", None), ("column", None), ("row", "all-reduce")])
def test_transposed_weight_copy_under_a_mesh(layout, reduction):
    """B as a decoded copy read transposed (NVFP4 16x16 weights' dgrad operand: data [K, N]): its shards follow
    the transposed layout (N split: the data's columns; K split: its rows), nothing is gathered, and the result
    equals the unsharded call (bit for bit where the contraction is not split)."""
    mesh = make_mesh(data=2, tensor=4)
    qs, x, w = _operands("nvfp4", seed=11)
    wt = w.T  # [K, N]: the weight as the dense op quantizes it for the forward (w.T's rows are its columns here)
    xs, wts = {"tokens": (P(("data", "tensor"), None), P(None, None)),
               "column": (P("data", None), P(None, "tensor")),
               "row": (P("data", "tensor"), P("tensor", None))}[layout]

    def fn(x, wt):
        a = quantize(x, qs.input, ("rowwise",), decoded=("rowwise",)).rowwise
        b = quantize(wt, qs.weight, ("rowwise",), decoded=("rowwise",)).rowwise.transpose_of()
        assert b.transposed and b.shape == (N_, K_)
        return table.gemm(a, b, jnp.float32)

    got, hlo = _compile(fn, mesh, (xs, wts), (x, wt))
    assert "jaxhq_gemm_dq" in hlo and "b_kn = 1" in jax.jit(fn).lower(x, wt).as_text()
    _check_collectives(hlo, reduction, f"transposed weight {layout}")
    ref = jax.jit(fn)(x, wt)
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    if reduction is None:
        assert np.array_equal(np.asarray(got), np.asarray(ref)), f"{layout}: max diff {diff.max():.3g}"
    else:
        a = quantize(x, qs.input, ("rowwise",)).rowwise
        b = quantize(w, qs.weight, ("rowwise",)).rowwise  # 16x16 blocks: the transposed copy's values
        bound = _bound(a, b)
        assert np.all(diff <= bound), f"{layout}: max diff/bound {np.max(diff / bound):.3g}"
