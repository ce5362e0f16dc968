"""MoE token dispatch: the capacity dispatch (per-group buffers [E, C, K]) equals the former replicated one when
no token is dropped (bit for bit on the CPU backend), dropped tokens give 0, and under expert parallelism (data 2 x
expert 4) the all-to-all dispatch equals the unsharded layer while each expert rank multiplies only its capacity's
rows.

The 8-device tests skip with fewer devices; test_sharding_launch.py runs them in an 8-device subprocess.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import re
from jax.sharding import NamedSharding

import jaxhq
from jaxhq import recipes
from jaxhq.layers import MoE
from jaxhq.sharding import axis_rules, make_mesh, mesh_axes, state_shardings
from jaxhq.sharding.hlo import collectives

RECIPES = ["bf16", "fp8_current", "mxfp8", "nvfp4"]


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


def _equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _close(a, b, rel=4e-5):
    """Equal up to fp32 summation order: the GEMMs see the same quantized operands in buffers of another row
    count, whose dot an XLA CPU backend may block differently (|diff| <= K u sum |a||b| for K <= 256 terms of
    these O(1) operands stays below 4e-5 of the tensor's largest value; a dispatch bug moves rows: O(1))."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert np.max(np.abs(u - v)) <= rel * np.max(np.abs(v)), f"max diff {np.max(np.abs(u - v)):.3g}"


def _same(a, b, rel=4e-5):
    """Two dispatches' results from the same quantized operands in buffers of other shapes: on the CPU backend
    their dots and reductions add the same terms in the same order, so bit for bit. A GPU backend picks its GEMM
    and reduction kernels by shape, and may reduce with atomics (two runs of the same pair differed there in the
    last bit, 2.4e-7 of O(1) values), so there: the summation-order tolerance of _close, or `rel` where a
    difference passes through a second quantization (its caller argues it)."""
    if jax.default_backend() == "cpu":
        _equal(a, b)
    else:
        _close(a, b, rel)


def _grouped(recipe_name, sizes, rows, **kw):
    rec = recipes.get(recipe_name)
    qs = [rec.dense_quantizers(f"moe.experts_{g}.fc1", "grouped_linear") for g in range(len(sizes))]
    x, ws, g = _normal(0, (rows, 64)), _normal(1, (len(sizes), 64, 96)), _normal(2, (rows, 96))

    def loss(x, ws):
        y = jaxhq.grouped_dense(x, ws, jnp.asarray(sizes), quantizers=qs, key=jax.random.key(7), **kw)
        return jnp.sum(y * g), y

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, ws)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_grouped_dense_capacity_equals_replicated(recipe_name):
    sizes = (100, 0, 60, 96)
    ref = _grouped(recipe_name, sizes, 256, dispatch="replicated")
    _same(_grouped(recipe_name, sizes, 256), ref)  # default capacity: 256 rows, the replicated length
    # 128 >= the largest group: the same quantized operands in shorter buffers (so equal up to summation order),
    # except NVFP4's stochastically rounded wgrad operand, whose random draws depend on the buffer's length.
    (loss, y), (dx, dws) = _grouped(recipe_name, sizes, 256, capacity=128)
    _close((loss, y, dx) + (() if recipe_name == "nvfp4" else (dws,)), (ref[0][0], ref[0][1], ref[1][0]) + (
        () if recipe_name == "nvfp4" else (ref[1][1],)))


def test_grouped_dense_drops_rows_past_the_capacity():
    (_, y), _ = _grouped("mxfp8", (200, 56), 256, capacity=128)
    (_, full), _ = _grouped("mxfp8", (200, 56), 256)
    y, full = np.asarray(y), np.asarray(full)
    assert not y[128:200].any() and full[128:200].any()
    np.testing.assert_array_equal(y[:128], full[:128])
    np.testing.assert_array_equal(y[200:], full[200:])


GROUPED_RECIPES = ["fp8_block", "mxfp8"]  # row-local forward and dgrad copies: what dispatch "grouped" takes
# (and high-precision ones: bf16, whose grouped GEMMs have a kernel on a Hopper only, XLA's ragged_dot elsewhere)


def _grouped_gemms_built():
    from jaxhq.ffi import gemm as G
    return G._registered()  # on the default backend


# dispatch "grouped" calls the extension's grouped GEMM targets; a source tree without the built extension has none
needs_grouped_gemms = pytest.mark.skipif(not _grouped_gemms_built(),
                                         reason="jaxhq FFI extension not built: no grouped GEMM target to call")


def _row_grouped_calls(hlo):
    """The grouped GEMM calls along rows (forward, dgrad) in a lowered program's text, not the wgrad's along K."""
    return re.findall(r'custom_call_target="jaxhq_gemm_\w*(?<!k)grouped"|@jaxhq_gemm_\w*(?<!k)grouped\b', hlo)


@needs_grouped_gemms
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("recipe_name", GROUPED_RECIPES + ["bf16"])
def test_grouped_gemm_dispatch_equals_capacity(recipe_name, dtype):
    """Dispatch "grouped" (forward and dgrad as one ragged grouped GEMM each over the sorted rows, the wgrad over
    each group's segment of the token axis) against the dropless capacity dispatch, with per-group biases, an
    empty group and rows past the groups: the same quantized operands (test_segment_copies_are_the_group_copies),
    so everything agrees up to the GEMMs' and sums' order (_close; in bf16 up to one rounding of each output,
    2^-8 of its magnitude, so 1e-2 of the largest, where a dispatch bug moves rows: O(1)); the grouped GEMM
    targets run (the bf16 recipe's: on a Hopper with CUTLASS, for bf16; else XLA's ragged_dot), and for bf16 on a
    Hopper with CUTLASS the wgrad is the one GEMM grouped along K (FP8 blockwise, or bf16 on MXFP8's decoded copies
    or the bf16 recipe's values; its kernels write bf16, float32 wgrads take the per-group GEMMs)."""
    rec = recipes.get(recipe_name)
    sizes = jnp.asarray((100, 0, 60, 80))  # 240 of 256 rows: the last 16 belong to no group
    qs = [rec.dense_quantizers(f"moe.experts_{g}.fc1", "grouped_linear") for g in range(4)]
    x, ws, b, g = (_normal(i, s).astype(dtype) for i, s in ((0, (256, 64)), (1, (4, 64, 96)), (3, (4, 96)),
                                                            (2, (256, 96))))

    def run(dispatch):
        def loss(x, ws, b):
            y = jaxhq.grouped_dense(x, ws, sizes, quantizers=qs, biases=b, dispatch=dispatch)
            return jnp.sum(y.astype(jnp.float32) * g), y
        fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
        return fn(x, ws, b), fn.lower(x, ws, b).as_text()

    ((loss, y), (dx, dws, db)), hlo = run("grouped")
    ((loss_r, y_r), (dx_r, dws_r, db_r)), _ = run("capacity")
    from jaxhq.ffi import gemm as G
    kernels = dtype == jnp.bfloat16 and G.CUTLASS_KGROUPED in G._cuda_targets() and G._hopper()
    assert len(_row_grouped_calls(hlo)) == (2 if recipe_name != "bf16" or kernels else 0), hlo
    if kernels:
        assert hlo.count(G.CUTLASS_KGROUPED) >= 1, hlo
    assert not np.asarray(y)[240:].any() and not np.asarray(dx)[240:].any()
    _close((loss, y, dx, dws, db), (loss_r, y_r, dx_r, dws_r, db_r), rel=4e-5 if dtype == jnp.float32 else 1e-2)


@needs_grouped_gemms
def test_grouped_gemm_dispatch_decoded_copies_equal_codes(monkeypatch):
    """Where the grouped MXFP8 GEMMs dequantize their operands (Hopper; the CPU handlers under JAXHQ_KERNELS=all),
    dispatch "grouped" asks, as the dense op does, for the copies its row-grouped GEMMs read at once to be written
    decoded: x's and the weights' rowwise ones (forward) and the gradient's rowwise one (dgrad), never the weights'
    columnwise codes kept for dgrad. The loss and every gradient equal those of the codes (JAXHQ_DECODED=0) bit for
    bit: the GEMMs read the same values."""
    from jaxhq.ffi import primitives as P
    from test_ffi_checks import spy_launches
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    sizes, rows = (100, 0, 60, 80), 256

    def run():
        launches = spy_launches(monkeypatch)
        out = _grouped("mxfp8", sizes, rows, dispatch="grouped")
        return out, {(shape, which): bool(opts & P.OPT_DECODED) for shape, _, row, col in launches
                     for which, (fmt, opts) in (("row", row), ("col", col)) if fmt}

    decoded, asked = run()
    # x [256, 64] and the gradient [256, 96] launch rowwise; each weight [64, 96] from the other side (its rowwise
    # copy, w.T's rows, is the launch's columnwise one), its dgrad copy on the launch's rowwise side
    assert asked[((256, 64), "row")] and asked[((256, 96), "row")], asked
    assert asked[((64, 96), "col")] and not asked[((64, 96), "row")], asked
    monkeypatch.setenv("JAXHQ_DECODED", "0")
    codes, asked = run()
    assert not any(asked.values()), asked
    _equal(decoded, codes)


@pytest.mark.parametrize("recipe_name", GROUPED_RECIPES)
def test_segment_copies_are_the_group_copies(recipe_name):
    """The wgrad's copies of dispatch "grouped": the columnwise copy of the segment-laid-out rows (to_segments:
    each group from a 128-row boundary) holds, in each group's segment, bit for bit the codes and scales of the
    columnwise copy of that group's dropless buffer (what the capacity dispatch multiplies); its blocks along the
    tokens never mix two groups. Sizes: ragged, empty and a whole block."""
    from jaxhq.formats import quantize
    from jaxhq.ops.grouped import to_experts, to_segments
    q = recipes.get(recipe_name).dense_quantizers("moe.experts_0.fc1", "grouped_linear").input
    x = _normal(0, (300, 64)) * 3
    sizes = jnp.asarray((100, 0, 128, 60))
    xp, seg = to_segments(x, sizes)
    assert np.asarray(seg).tolist() == [128, 0, 128, 128] and xp.shape[0] % 128 == 0
    whole = quantize(xp, q, "columnwise").columnwise
    block = whole.data.shape[1] // whole.scale_inv.shape[1]  # tokens per scale
    start = 0
    for g, s in enumerate(np.asarray(seg)):
        own = quantize(to_experts(x, sizes, 128)[g], q, "columnwise").columnwise  # [64, 128]
        cols = slice(start, start + s)
        np.testing.assert_array_equal(np.asarray(whole.data[:, cols], np.float32)[:, :s],
                                      np.asarray(own.data, np.float32)[:, :s])
        np.testing.assert_array_equal(np.asarray(whole.scale_inv)[:, start // block:(start + s) // block],
                                      np.asarray(own.scale_inv)[:, :s // block])
        start += s


@needs_grouped_gemms
def test_grouped_gemm_dispatch_stochastic_wgrad_copies_take_the_capacity_keys():
    """Row-local forward and dgrad copies (MXFP8) with stochastically rounded NVFP4 wgrad copies: the grouped
    dispatch gives each group the keys the capacity dispatch gives it, so with the same buffer length the weight
    gradient is the same (bits on the CPU backend: _same); another key changes it."""
    act = jaxhq.Hybrid(jaxhq.MXFP8(), jaxhq.NVFP4(stochastic_rounding=True))
    qs = [recipes.DenseQuantizers(act, jaxhq.MXFP8(), act) for _ in range(3)]
    sizes = jnp.asarray((100, 60, 80))
    x, ws, g = _normal(0, (256, 64)), _normal(1, (3, 64, 96)), _normal(2, (256, 96))

    def dw(dispatch, seed):
        f = lambda ws: jnp.sum(jaxhq.grouped_dense(x, ws, sizes, quantizers=qs, key=jax.random.key(seed),  # noqa
                                                   dispatch=dispatch) * g)
        return jax.jit(jax.grad(f))(ws)

    _same(dw("grouped", 7), dw("capacity", 7))
    assert not np.array_equal(np.asarray(dw("grouped", 7)), np.asarray(dw("grouped", 8)))


@pytest.mark.parametrize("recipe_name, kw, match", [
    ("fp8_current", {}, r"moe\.experts_0\.fc1.*input's rowwise copy \(fp8_e4m3.*not row-local"),
    ("nvfp4", {}, r"input's rowwise copy \(nvfp4.*not row-local"),
    ("fp8_delayed", {}, "delayed-scaling state"),
    ("mxfp8", {"capacity": 128}, "drops no rows"),
])
def test_grouped_gemm_dispatch_says_what_it_cannot_take(recipe_name, kw, match):
    rec = recipes.get(recipe_name)
    qs = [rec.dense_quantizers(f"moe.experts_{g}.fc1", "grouped_linear") for g in range(2)]
    with pytest.raises(ValueError, match=match):
        jaxhq.grouped_dense(_normal(0, (256, 64)), _normal(1, (2, 64, 96)), jnp.asarray((100, 60)), quantizers=qs,
                            dispatch="grouped", **kw)


def _moe_grads(model, x):
    variables = model.init(jax.random.key(1), x)

    def loss(p, x):
        out = model.apply({"params": p}, x, rngs={"quant": jax.random.key(2)})
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(nn.unbox(variables["params"]), x)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_moe_capacity_equals_replicated(recipe_name):
    """MoE (4 experts, top-2, 128 tokens): dropless capacity (128 rows per expert, not 256) equals the
    replicated dispatch; NVFP4 (stochastic rounding) with the replicated buffer length, capacity factor 4. Off the
    CPU backend, within the tolerance of test_moe_grouped_gemm_dispatch_equals_replicated (fc2 quantizes fc1's
    outputs again, so a last-bit difference may move one code by a step)."""
    x = _normal(3, (2, 64, 64))
    kw = dict(capacity_factor=4.0) if recipe_name == "nvfp4" else {}
    make = lambda **k: MoE(4, 2, 64, recipes.get(recipe_name), activation="gelu", name="moe", **k)  # noqa: E731
    _same(_moe_grads(make(**kw), x), _moe_grads(make(dispatch="replicated"), x), rel=2e-2)


@needs_grouped_gemms
@pytest.mark.parametrize("recipe_name", GROUPED_RECIPES)
def test_moe_grouped_gemm_dispatch_equals_replicated(recipe_name):
    """MoE (4 experts, top-2, 128 tokens) with dispatch "grouped": the same sort as "replicated", fc1 and fc2 on
    the grouped GEMMs. fc1's outputs agree up to summation order (measured: 6e-8 of the largest), but fc2 quantizes
    them again, and where one lies on an FP8 rounding boundary its code may differ by one step (at most 1/8 of its
    block's largest value), which moves a few outputs by up to about 1e-2 of the largest; a wiring error (a row
    to the wrong expert, a lost bias or activation) moves them by O(1). A capacity factor is refused."""
    x = _normal(3, (2, 64, 64))
    make = lambda **k: MoE(4, 2, 64, recipes.get(recipe_name), activation="gelu", name="moe", **k)  # noqa: E731
    _close(_moe_grads(make(dispatch="grouped"), x), _moe_grads(make(dispatch="replicated"), x), rel=2e-2)
    model = make(dispatch="grouped")
    params = model.init(jax.random.key(1), x)
    hlo = jax.jit(model.apply).lower(params, x).as_text()
    assert len(_row_grouped_calls(hlo)) == 2
    with pytest.raises(ValueError, match="drops no tokens"):
        make(dispatch="grouped", capacity_factor=1.25).init(jax.random.key(1), x)


@needs_grouped_gemms
def test_transformer_layer_passes_the_moe_dispatch():
    """MoEConfig(dispatch="grouped") reaches the layer's MoE: fc1 and fc2 run the grouped GEMMs, and the layer's
    output and gradients agree with dispatch "replicated" (tolerance as in the MoE test above)."""
    from jaxhq.layers import MoEConfig, TransformerLayer
    x = _normal(4, (2, 32, 64))
    make = lambda d: TransformerLayer(4, 64, recipes.get("mxfp8"), moe=MoEConfig(4, 2, 32, dispatch=d),  # noqa: E731
                                      name="layers_0")
    model = make("grouped")
    hlo = jax.jit(model.apply).lower(model.init(jax.random.key(1), x), x).as_text()
    assert len(_row_grouped_calls(hlo)) == 2
    _close(_moe_grads(model, x), _moe_grads(make("replicated"), x), rel=2e-2)


@pytest.fixture
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                    "test_sharding_launch.py runs this file that way")


E, K, T, D = 8, 2, 2048, 64  # 256 tokens per device; capacity factor 1: 128 rows per expert per token shard


@pytest.mark.parametrize("recipe_name", ["mxfp8", "nvfp4"])
def test_sharded_all_to_all_dispatch_equals_unsharded(_eight_devices, recipe_name):
    """(data 2, expert 4): tokens reach their experts' ranks by all-to-all; the layer equals the unsharded one
    with the same buffer layout (8 token shards), and each expert rank multiplies only its capacity's rows."""
    mesh, rules = make_mesh(data=2, expert=4), axis_rules()
    x = _normal(4, (8, T // 8, D))
    make = lambda **k: MoE(E, K, D, recipes.get(recipe_name), activation="gelu", name="moe",  # noqa: E731
                           capacity_factor=1.0, **k)
    (r_loss, r_out), (r_dp, r_dx) = _moe_grads(make(dispatch_shards=8), x)
    model = make()
    boxed = model.init(jax.random.key(1), x)["params"]

    def loss(p, x):
        out = model.apply({"params": p}, x, rngs={"quant": jax.random.key(2)})
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    params, ps = nn.unbox(boxed), state_shardings(boxed, mesh, rules)
    xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        placed = (jax.device_put(params, ps), jax.device_put(x, xs))
        compiled = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(*placed).compile()
    (loss_, out), (dp, dx) = compiled(*placed)
    # Same numbers up to fp32 summation order: every expert GEMM row sees the same quantized operands (per-tensor
    # amaxes are global, token blocks start at the same buffer rows), but the CPU dot may round a row by an ulp
    # depending on the matrix's row count (512 rows per device against 1024 unsharded, and the router's
    # logits likewise); an expert's wgrad adds two per-device partial sums (data axis) by a psum, the router
    # gradient and the loss sum over the 8 devices. Those ulps re-quantized in the backward (dy's block codes)
    # flip a few codes of every gradient (dx, expert kernels): ~3e-4 relative (see test_sharding_model.py's
    # tolerance note). A dispatch bug (a row at the wrong expert or slot) is O(1).
    for path, got in jax.tree_util.tree_leaves_with_path((loss_, out, dp, dx)):
        want = np.asarray(dict(jax.tree_util.tree_leaves_with_path((r_loss, r_out, r_dp, r_dx)))[path], np.float64)
        rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert rel <= (1e-6 if path[0].idx < 2 else 1e-3), (jax.tree_util.keystr(path), rel)

    hlo = compiled.as_text()
    cap = 128  # per token shard and expert
    moves = [c for c in collectives(hlo, None) if c.kind in ("all-gather", "all-to-all", "collective-permute")
             and c.shape[-1:] == (D,) and len(c.shape) > 1]
    assert moves and all(c.kind == "all-to-all" and c.shape == (E // 4, cap, D) for c in moves), moves
    # Per-device expert GEMMs [local experts, rows, ...]: 4 token shards x 128 rows per expert, where the
    # replicated dispatch gives every expert all T * K / data = 2048 rows.
    # (XLA's dot batched over the local experts, or with JAXHQ_KERNELS=all the FFI GEMM called per expert)
    rows = {int(m) for m in re.findall(rf"f32\[{E // 4},(\d+),\d+\]\S* dot\(", hlo)}
    # (the dense GEMM targets return (out, uint8 workspace))
    rows |= {int(m) for m in re.findall(r"\[(\d+),\d+\]\S*(?:, u8\[\d+\]\S*)? custom-call\([^\n]*jaxhq_gemm", hlo)}
    assert 4 * cap in rows and max(rows) == 4 * cap < T * K // 2, rows
