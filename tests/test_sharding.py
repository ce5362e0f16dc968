"""Sharding on 8 CPU devices: mesh and rules, global amax, quantized all-gather bit-equal to unsharded
quantization with uint8 gathers in the compiled HLO, misaligned shards rejected, and a sharded training step
equal to the unsharded one on the (8 dp), (2 dp, 4 fsdp), (2 fsdp, 4 tp), (2 dp, 2 fsdp, 2 tp) and expert meshes.

Needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (test_sharding_launch.py does
that in a subprocess when the suite runs with fewer devices; here the tests skip).
"""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import test_sharding_model as M
import jaxhq
from jaxhq import recipes
from jaxhq.formats import (MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Float8DelayedScaling, Hybrid, Identity,
                           init_state, quantize)
from jaxhq.recipes import DenseQuantizers
from jaxhq.roles import gemm_roles
from jaxhq.sharding import (ShardingError, axis_rules, expert_sharding, global_amax, make_mesh, mesh_axes,
                            shard_state, state_shardings, weight_sharding)
from jaxhq.sharding.hlo import collectives


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                    "test_sharding_launch.py runs this file that way")


MESHES = {"dp8": dict(data=8), "dp2_fsdp4": dict(data=2, fsdp=4), "fsdp2_tp4": dict(fsdp=2, tensor=4),
          "dp2_fsdp2_tp2": dict(data=2, fsdp=2, tensor=2)}
RECIPES = ["fp8_current", "mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4"]


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32) if a.dtype.itemsize == 4 else a


def _same(a, b):
    """Bit equality (NaN == NaN) of two arrays of any dtype."""
    return a is None and b is None or (np.shape(a) == np.shape(b) and np.array_equal(_bytes(a), _bytes(b)))


# -- mesh and rules ----------------------------------------------------------------------------------------
def test_make_mesh_axes_and_errors():
    m = make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(zip(m.axis_names, m.axis_sizes)) == dict(data=2, expert=1, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="= 4 devices, but 8"):
        make_mesh(data=2, fsdp=2)
    with pytest.raises(ValueError, match="positive"):
        make_mesh(data=0)


def test_rules_map_logical_axes():
    r = axis_rules()
    assert mesh_axes(("embed", "mlp"), r) == P("fsdp", "tensor")  # column parallel, FSDP on embed
    assert mesh_axes(("mlp", "embed"), r) == P("tensor", "fsdp")  # row parallel
    assert mesh_axes(("embed", ("heads", "kv")), r) == P("fsdp", "tensor")  # fused qkv output
    assert mesh_axes(("expert", "embed", "mlp"), r) == P("expert", "fsdp", "tensor")
    assert mesh_axes(("vocab", "embed"), r) == P("tensor", "fsdp")
    # Activations: batch takes data/fsdp/expert first, so embed stays whole; length only with SP.
    assert mesh_axes(("batch", "length", "embed"), r) == P(("data", "fsdp", "expert"), None, None)
    sp = axis_rules(sequence_parallel=True)
    assert mesh_axes(("batch", "length", "embed"), sp) == P(("data", "fsdp", "expert"), "tensor", None)
    assert mesh_axes(("batch", "length", "heads", "kv"), sp) == P(("data", "fsdp", "expert"), None, "tensor", None)
    assert mesh_axes(("batch", "length", "mlp"), sp) == P(("data", "fsdp", "expert"), None, "tensor")
    # Axes the mesh lacks are dropped.
    small = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert mesh_axes(("batch", "embed", "mlp"), r, small) == P(("data", "fsdp"), None, None)
    assert mesh_axes(("embed", "mlp"), r, small) == P("fsdp", None)


def test_constrain_takes_mesh_and_rules_from_the_context():
    """Under jax.set_mesh and nn.logical_axis_rules, `constrain` uses both (sequence parallel: length on tensor)."""
    from jaxhq.sharding import constrain
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    x = jnp.ones((8, 32, 16))
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(sequence_parallel=True)):
        y = jax.jit(lambda x: constrain(x, ("batch", "length", "embed")) * 2)(x)
    assert y.addressable_shards[0].data.shape == (2, 16, 16)  # batch over data x fsdp, length over tensor


def test_shard_state_places_boxed_params_by_rules():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("up", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")), (64, 128))
            b = self.param("bias", nn.initializers.zeros, (128,))
            return x @ k + b

    variables = Block().init(jax.random.key(0), jnp.ones((2, 64)))
    placed = shard_state(variables, mesh, axis_rules())
    up = placed["params"]["up"]
    assert isinstance(up, nn.Partitioned)
    assert up.value.sharding.spec == P("fsdp", "tensor")
    assert up.value.addressable_shards[0].data.shape == (32, 64)
    assert placed["params"]["bias"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(up.value), np.asarray(variables["params"]["up"].value))
    # Unboxed state with explicit logical axes.
    st = {"w": jnp.arange(64 * 8.0).reshape(64, 8), "step": jnp.zeros((), jnp.int32)}
    placed = shard_state(st, mesh, axis_rules(), logical_axes={"w": ("embed", "mlp"), "step": None})
    assert placed["w"].sharding.spec == P("fsdp", "tensor") and placed["step"].sharding.spec == P()


# -- global amax -------------------------------------------------------------------------------------------
def test_amax_of_sharded_tensor_is_global_under_jit():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    x[37, 5] = -50.0  # the max sits on one shard only
    sh = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    f = jax.jit(lambda a: jnp.max(jnp.abs(a)))
    assert float(f(jax.device_put(x, sh))) == 50.0
    hlo = f.lower(jax.device_put(x, sh)).compile().as_text()
    assert any(c.kind == "all-reduce" for c in collectives(hlo, None)), "no all-reduce for a sharded amax"
    # The quantizers' own amax (NaN-preserving) is global too, and the scales agree on every device.
    qf = jax.jit(lambda a: quantize(a, Float8CurrentScaling(), ("rowwise",)).rowwise.scale_inv)
    s = qf(jax.device_put(x, sh))
    ref = quantize(jnp.asarray(x), Float8CurrentScaling(), ("rowwise",)).rowwise.scale_inv
    assert _same(s, ref)
    # shard_map: each device sees its shard; global_amax reduces over the named axes; NaN survives.
    from jax import shard_map
    spec = P(("data", "fsdp"), "tensor")
    g = jax.jit(shard_map(lambda a: global_amax(a, ("data", "fsdp", "tensor")), mesh=mesh, in_specs=spec,
                          out_specs=P()))
    assert float(g(jax.device_put(x, sh))) == 50.0
    # one all-reduce (the max of the bit patterns carries the NaN flag)
    assert [c.kind for c in collectives(g.lower(jax.device_put(x, sh)).compile().as_text(), None)] == ["all-reduce"]
    x[7, 60] = -np.inf  # on another shard
    assert float(g(jax.device_put(x, sh))) == np.inf
    x[3, 90] = np.nan  # on one shard: global_amax is NaN on every device (a max all-reduce may drop NaNs)
    got = np.asarray(g(jax.device_put(x, sh)), np.float32)
    assert np.isnan(got) and got.view(np.uint32) == np.float32(np.nan).view(np.uint32)  # the canonical NaN


# -- quantized all-gather ----------------------------------------------------------------------------------
WEIGHT_QUANTIZERS = [Float8CurrentScaling("e4m3"), Float8DelayedScaling("e4m3", history_len=4), MXFP8("e4m3"),
                     NVFP4(), NVFP4(block_2d=True), NVFP4(rht=True), Float8Block((1, 128)),
                     Float8Block((128, 128)), Hybrid(MXFP8("e4m3"), NVFP4(block_2d=True)), Identity()]
GATHER_MESHES = {"dp2_fsdp4": (dict(data=2, fsdp=4), (512, 128)), "fsdp2_tp4": (dict(fsdp=2, tensor=4), (256, 512))}


@pytest.mark.parametrize("mesh_name", list(GATHER_MESHES))
@pytest.mark.parametrize("q", WEIGHT_QUANTIZERS, ids=lambda q: q.label)
def test_quantized_gather_is_bit_equal_and_moves_bytes(q, mesh_name):
    sizes, shape = GATHER_MESHES[mesh_name]
    mesh = make_mesh(**sizes)
    rng = np.random.default_rng(hash((q.label, mesh_name)) % 2 ** 32)
    kernel = (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))).astype(np.float32)
    ws = weight_sharding(("embed", "mlp"), "layers_0.up", mesh=mesh)
    role = gemm_roles("layers_0.up")["weight"]
    ws.check(q, shape, role)
    state = init_state(q)
    if state is not None:
        state = jax.tree.map(lambda a: a * 3.0, state)

    def f(k, st):
        qt = ws.shard(quantize(k.T, q, state=st))
        return ws.gathered(qt.rowwise), ws.gathered(qt.columnwise)

    ksh = NamedSharding(mesh, ws.kernel_spec())
    compiled = jax.jit(f, in_shardings=(ksh, None)).lower(jax.device_put(kernel, ksh), state).compile()
    row, col = compiled(jax.device_put(kernel, ksh), state)
    ref = jax.jit(lambda k, st: quantize(k.T, q, state=st))(jnp.asarray(kernel), state)
    for got, want in ((row, ref.rowwise), (col, ref.columnwise)):
        for field in ("data", "scale_inv", "amax"):
            assert _same(getattr(got, field), getattr(want, field)), (q.label, got.axis, field)
    gathers = collectives(compiled.as_text())
    if ws.needs_gather:
        assert gathers, "expected all-gathers of the quantized weight"
    for c in gathers:
        if isinstance(q, Identity):
            assert c.dtype == "f32"
        elif c.dtype != "u8":  # only FP8 blockwise's fp32 block scales, 1 per >= 128 elements
            assert isinstance(q, Float8Block) and c.dtype == "f32" and np.prod(c.shape) * 128 <= np.prod(shape), \
                f"{q.label}: weight all-gather of {c.dtype}{list(c.shape)}, expected u8"


def test_misaligned_shards_raise_naming_role_shard_and_block():
    mesh = make_mesh(data=2, fsdp=4)
    role = gemm_roles("layers_3.mlp.up")["weight"]
    ws = weight_sharding(("embed", "mlp"), "layers_3.mlp.up", mesh=mesh)
    with pytest.raises(ShardingError, match=r"layers_3\.mlp\.up.*shard size of 48.*32-element block"):
        ws.check(MXFP8(), (192, 64), role)  # in = 192 split 4 ways: 48 per shard, blocks of 32
    ws.check(MXFP8(), (256, 64), role)  # 64 per shard: fine
    ws.check(Float8CurrentScaling(), (192, 64), role)  # per-tensor: no block to straddle
    tp = weight_sharding(("embed", "mlp"), mesh=make_mesh(fsdp=2, tensor=4))
    with pytest.raises(ShardingError, match=r"columnwise.*shard size of 8.*16-element block"):
        tp.check(NVFP4(), (64, 32), role)  # out = 32 split 4 ways on tensor: blocks of the columnwise copy
    with pytest.raises(ShardingError, match=r"rowwise.*16x16.*shard size of 8.*16-element block"):
        tp.check(NVFP4(block_2d=True), (64, 32), role)  # 16x16 tiles: the rows of the rowwise copy too
    with pytest.raises(ShardingError, match=r"shard size of 64.*128-element block"):
        tp.check(Float8Block((1, 128)), (128, 256), role)
    # The dense op raises at trace time, before anything runs.
    qs = DenseQuantizers.uniform(MXFP8(), roles=tuple(gemm_roles("layers_3.mlp.up").values()))
    from jaxhq.ops import dense
    with pytest.raises(ShardingError, match=r"weight linear/weight@layers_3\.mlp\.up"):
        jax.eval_shape(lambda x, k: dense(x, k, quantizers=qs, weight_sharding=ws),
                       jax.ShapeDtypeStruct((8, 192), jnp.float32), jax.ShapeDtypeStruct((192, 64), jnp.float32))


def test_delayed_scaling_state_is_global_under_fsdp():
    """Delayed scaling's amax history after a sharded dense equals the unsharded one (global amax)."""
    mesh = make_mesh(data=2, fsdp=4)
    q = Float8DelayedScaling("e4m3", history_len=4)
    qs = DenseQuantizers.uniform(q, Float8DelayedScaling("e5m2", history_len=4),
                                 roles=tuple(gemm_roles("l.up").values()))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    states = {s: init_state(getattr(qs, s)) for s in ("input", "weight", "grad_output")}
    from jaxhq.ops import dense

    def f(x, k, states, mesh):
        ws = None if mesh is None else weight_sharding(("embed", "mlp"), mesh=mesh)
        def loss(x, k, st):
            y, new = dense(x, k, quantizers=qs, states=st, weight_sharding=ws, return_state=True)
            return jnp.sum(y ** 2), new
        (l, new), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, k, states)
        return l, new, g[2]["grad_output"]

    ref = jax.jit(lambda *a: f(*a, None))(x, k, states)
    xs = NamedSharding(mesh, P(("data", "fsdp"), None))
    ks = NamedSharding(mesh, P("fsdp", None))
    got = jax.jit(lambda *a: f(*a, mesh))(jax.device_put(x, xs), jax.device_put(k, ks), states)
    for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(ref[1:])):
        assert _same(a, b)


# -- the dense op: sharded == unsharded up to the GEMMs' summation order ----------------------------------------
@pytest.mark.parametrize("mesh_name, recipe_name", [
    pytest.param(m, r, marks=pytest.mark.slow if m == "dp8" and r != "fp8_current" else ())
    for m in MESHES for r in RECIPES])
def test_dense_op_sharded_equals_unsharded_up_to_summation_order(mesh_name, recipe_name):
    """A column-parallel and a row-parallel dense (forward and both backward GEMMs) on identical inputs:
    quantized operands are bit-identical, so outputs differ only by fp32 summation order, within the bound."""
    from jaxhq.ops import dense
    mesh, recipe = make_mesh(**MESHES[mesh_name]), recipes.get(recipe_name)
    rng = np.random.default_rng(11)
    t, d, f = 256, M.D, M.F
    x1, w1, g1 = rng.standard_normal((t, d)), rng.standard_normal((d, f)) / d ** .5, rng.standard_normal((t, f))
    x2, w2, g2 = rng.standard_normal((t, f)), rng.standard_normal((f, d)) / f ** .5, rng.standard_normal((t, d))
    args = tuple(jnp.asarray(a, jnp.float32) for a in (x1, w1, g1, x2, w2, g2))

    def f_(x1, w1, g1, x2, w2, g2, mesh):
        out = []
        for i, (x, w, g, axes) in enumerate(((x1, w1, g1, ("embed", "mlp")), (x2, w2, g2, ("mlp", "embed")))):
            ws = None if mesh is None else weight_sharding(axes, f"l.{i}", mesh=mesh)
            qs = recipe.dense_quantizers(f"layers_0.d{i}")
            y, vjp = jax.vjp(lambda x, w: dense(x, w, quantizers=qs, weight_sharding=ws, key=jax.random.key(i)),
                             x, w)
            out += [y, *vjp(g)]
        return out

    ref = _dense_reference(recipe_name, f_, args)
    rules = axis_rules()
    act = lambda names: NamedSharding(mesh, mesh_axes(names, rules, mesh))
    shard = (act(("batch", "embed")), act(("embed", "mlp")), act(("batch", "mlp")), act(("batch", "mlp")),
             act(("mlp", "embed")), act(("batch", "embed")))
    got = jax.jit(lambda *a: f_(*a, mesh))(*(jax.device_put(a, s) for a, s in zip(args, shard)))
    bounds = [M.order_bound(x1, w1), M.order_bound(g1, w1.T), M.order_bound(x1.T, g1),
              M.order_bound(x2, w2), M.order_bound(g2, w2.T), M.order_bound(x2.T, g2)]
    for name, a, b, bound in zip(["y1", "dx1", "dw1", "y2", "dx2", "dw2"], got, ref, bounds):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= bound), f"{name}: max diff/bound {np.max(diff / bound):.3g}"


_DENSE_REFS = {}


def _dense_reference(recipe_name, fn, args):
    if recipe_name not in _DENSE_REFS:
        _DENSE_REFS[recipe_name] = jax.jit(lambda *a: fn(*a, None))(*args)
    return _DENSE_REFS[recipe_name]


# -- the training step --------------------------------------------------------------------------------------
def _weight_gathers(hlo, tensor=1):
    """All-gathers producing an array of a gathered kernel copy's shape: [D, F/tp] or [F/tp, D] (the test
    model's kernel dims are not powers of two, its token counts are: no activation has these shapes)."""
    shapes = {(M.D, M.F // tensor), (M.F // tensor, M.D)}
    return [c for c in collectives(hlo) if c.shape in shapes]


def _quantized_gathers(hlo):
    return [c for c in collectives(hlo) if c.dtype == "u8"]


_close = M.assert_close


def _check_step(recipe_name, mesh, experts=False):
    params, batch = M.init_params(0, experts)
    key = jax.random.key(1)
    jitted, ps, bs = M.sharded_step(recipes.get(recipe_name), key, mesh, params)
    placed = (jax.device_put(params, ps), jax.device_put(batch, bs))
    compiled = jitted.lower(*placed).compile()
    loss, grads, _ = compiled(*placed)
    r_loss, r_grads, _ = M.reference(recipe_name, experts)
    e_loss, e_grads, _ = M.reference("bf16", experts)
    frac = M.noise_fraction(recipe_name)
    _close(loss, r_loss, e_loss, "loss", frac)
    got = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r, e in zip(got, jax.tree.leaves(r_grads), jax.tree.leaves(e_grads)):
        _close(g, r, e, f"grad {jax.tree_util.keystr(path)}", frac)
    return compiled.as_text()


# The dense-op test above checks every mesh x recipe rigorously; the step tests check the integration. Every
# combination compiles 20 steps (minutes of CPU): the suite runs these (all of dp, fsdp and tp together with
# the per-tensor and the FP4 recipe, FSDP with the hybrid), the rest are marked slow.
CORE = {("dp2_fsdp2_tp2", "fp8_current"), ("dp2_fsdp2_tp2", "nvfp4"), ("dp2_fsdp4", "hybrid:mxfp8:nvfp4")}
STEP_CASES = [pytest.param(m, r, marks=() if (m, r) in CORE else pytest.mark.slow) for m in MESHES for r in RECIPES]


@pytest.mark.parametrize("mesh_name, recipe_name", STEP_CASES)
def test_sharded_step_equals_unsharded_and_gathers_quantized_bytes(mesh_name, recipe_name):
    sizes = MESHES[mesh_name]
    hlo = _check_step(recipe_name, make_mesh(**sizes))
    bad = [c for c in _weight_gathers(hlo, sizes.get("tensor", 1)) if c.dtype != "u8"]
    assert not bad, f"weight all-gathers not in quantized bytes: {bad}"
    if sizes.get("fsdp", 1) > 1:
        # 4 kernels, each gathered as rowwise (forward) and columnwise (backward) data, as uint8.
        assert len(_quantized_gathers(hlo)) >= 8, collectives(hlo)


# -- the GEMMs gather no activation (the FFI GEMMs are partitioned) ------------------------------------------
GATHER_RECIPES = RECIPES  # fp8_delayed runs the same GEMMs as fp8_current; fp8_block needs 128-row shards
STEP_MESHES = ["dp2_fsdp4", "fsdp2_tp4", "dp2_fsdp2_tp2"]


def _step_hlo(recipe_name, mesh_name, sp=False):
    mesh = make_mesh(**MESHES[mesh_name])
    params, _ = M.init_params(0)
    with nn.logical_axis_rules(axis_rules(sequence_parallel=sp)):
        jitted, ps, bs = M.sharded_step(recipes.get(recipe_name), jax.random.key(1), mesh, params)
        return jitted.lower(jax.device_put(params, ps), jax.device_put(M.init_params(0)[1], bs)).compile().as_text()


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
@pytest.mark.parametrize("mesh_name", STEP_MESHES)
@pytest.mark.parametrize("recipe_name", GATHER_RECIPES)
def test_gemms_gather_no_activation(monkeypatch, recipe_name, mesh_name, sp):
    """Every GEMM of the step (forward, dgrad, wgrad) is an FFI custom call (the CPU handlers: the same program
    structure as on a GPU), partitioned: tokens stay split, column- and row-parallel weights keep their split,
    a split contraction is reduced; the only all-gathers left move the quantized FSDP weights. Under sequence
    parallelism the length-split activations are gathered too, as uint8 codes; where a block along tokens would
    straddle the length shards (a warning says so) in high precision, the residual stream's [L, D] rows."""
    if sp and "tp" not in mesh_name:
        pytest.skip("sequence parallelism splits the sequence on the tensor axis")
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = _step_hlo(recipe_name, mesh_name, sp)
    assert "jaxhq_gemm" in hlo, "the GEMMs did not run the FFI targets"
    bad = M.activation_gathers(hlo, MESHES[mesh_name].get("tensor", 1))
    if sp:
        fell_back = any("straddle" in str(w.message) for w in caught)
        bad = [c for c in bad if c.dtype != "u8" and not (fell_back and c.shape[-2:] == (M.L, M.D))]
    assert not bad, f"activations gathered: {bad}"


def test_fsdp_step_transposes_no_mxfp8_scales():
    """The launches write MXFP8 scales [blocks, rows] and the GEMMs read them so (ffi.primitives.swap_rows_inner);
    the sharded weights' scales are constrained and all-gathered in that layout too (WeightSharding._storage), so
    the FSDP step's program transposes no E8M0 scale array between a quantize launch and a GEMM (gathering them in
    the Storage's layout put a transpose on each side of every gather)."""
    import re
    hlo = _step_hlo("mxfp8", "dp2_fsdp4")
    assert "jaxhq_gemm_dq" in hlo
    bad = [ln.strip() for ln in hlo.splitlines() if re.search(r"= (u8|f8e8m0fnu)\[[\d,]+\]\{[\d,]+\} transpose\(", ln)]
    assert not bad, bad[:4]


def test_unpartitioned_gemms_would_gather_activations(monkeypatch):
    """Control for the test above: the same FFI GEMMs called without their partitioning rule make XLA gather
    their operands (activations included) onto every device."""
    from jaxhq.ffi import partitioning
    monkeypatch.setenv("JAXHQ_KERNELS", "all")
    monkeypatch.setattr(partitioning, "gemm", lambda kernel, a, b, out_dtype, **kw: kernel(a, b, out_dtype, **kw))
    assert M.activation_gathers(_step_hlo("mxfp8", "dp2_fsdp2_tp2"), 2)


def test_without_the_hook_xla_gathers_high_precision_weights():
    """Control for the HLO assertion above: plain jit gathers the weights in f32/bf16."""
    mesh = make_mesh(data=2, fsdp=4)
    params, batch = M.init_params(0)
    jitted, ps, bs = M.sharded_step(recipes.get("mxfp8"), jax.random.key(1), mesh, params, hook=False)
    hlo = jitted.lower(jax.device_put(params, ps), jax.device_put(batch, bs)).compile().as_text()
    assert any(c.dtype in ("f32", "bf16", "f16") for c in _weight_gathers(hlo))
    assert not _quantized_gathers(hlo)


def _expert_kernel_moves(hlo):
    """Collectives that move (not reduce) an array of an expert kernel's per-expert shape, whole or split on
    fsdp: [1 or 2, D, F], [.., F, D], [.., D/2, F], [.., F, D/2]."""
    shapes = {(M.D, M.F), (M.F, M.D), (M.D // 2, M.F), (M.F, M.D // 2)}
    return [c for c in collectives(hlo, None) if c.kind in ("all-gather", "collective-permute", "all-to-all")
            and len(c.shape) == 3 and c.shape[1:] in shapes]


@pytest.mark.parametrize("recipe_name", [r if r == "mxfp8" else pytest.param(r, marks=pytest.mark.slow)
                                         for r in RECIPES])
def test_expert_mesh_step_equals_unsharded(recipe_name):
    """Expert mesh (2 expert, 2 fsdp, 2 dp): layer 1 is a 2-expert grouped dense with kernels split on expert.
    Each expert rank computes its own expert: no expert kernel moves between devices except as the quantized
    bytes of its FSDP gather (before expert parallelism they moved in f32)."""
    hlo = _check_step(recipe_name, make_mesh(data=2, fsdp=2, expert=2), experts=True)
    moves = _expert_kernel_moves(hlo)
    assert moves and all(c.dtype == "u8" and c.shape[0] == 1 for c in moves), moves


def test_expert_sharding_errors_name_the_layer():
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    es = expert_sharding(("expert", "embed", "mlp"), "layers_1.moe.fc1", mesh=mesh)
    assert es.axes == ("expert",) and es.tokens == ("data", "fsdp")
    assert expert_sharding(("expert", "embed", "mlp"), mesh=make_mesh(data=8)) is None  # experts not split
    qs = [recipes.mxfp8().dense_quantizers(f"layers_1.moe.experts_{g}.fc1", "grouped_linear") for g in range(3)]
    x, ws = jnp.ones((64, M.D)), jnp.ones((3, M.D, M.F))
    with pytest.raises(ShardingError, match=r"layers_1\.moe\.fc1.*3 experts.*\('expert',\).*multiple of 2"):
        jaxhq.grouped_dense(x, ws, jnp.array([32, 32, 0]), quantizers=qs, expert_sharding=es)
    # Experts with different quantizers cannot be split: they run one by one (correct), with a warning.
    mixed = qs[:1] + [recipes.nvfp4().dense_quantizers("layers_1.moe.experts_1.fc1", "grouped_linear")]
    with pytest.warns(UserWarning, match=r"weight@layers_1\.moe\.experts_0\.fc1.*different quantizers"):
        y = jaxhq.grouped_dense(x, ws[:2], jnp.array([32, 32]), quantizers=mixed, expert_sharding=es)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(
        jaxhq.grouped_dense(x, ws[:2], jnp.array([32, 32]), quantizers=mixed)))


@pytest.mark.parametrize("recipe_name", ["mxfp8", pytest.param("fp8_delayed", marks=pytest.mark.slow)])
def test_moe_layer_expert_parallel_equals_unsharded(recipe_name):
    """The MoE layer (4 experts, top-2) under jax.set_mesh + rules on (2 data, 2 fsdp, 2 expert): its
    GroupedDense layers pick up the expert sharding from the mesh; loss and gradients equal the unsharded
    layer's up to fp32 summation order, and the expert kernels never move in high precision."""
    from jaxhq.layers import MoE
    mesh, rules = make_mesh(data=2, fsdp=2, expert=2), axis_rules()
    recipe = recipes.get(recipe_name)
    model = MoE(num_experts=4, top_k=2, d_ff=M.F, recipe=recipe, activation="gelu", name="moe")
    x = jax.random.normal(jax.random.key(0), (M.B, M.L, M.D))
    variables = model.init(jax.random.key(1), x)
    boxed = variables["params"]
    state = nn.unbox(variables.get("quant_state", {}))

    def loss(p, qst, x):
        out = model.apply({"params": p, "quant_state": qst}, x, rngs={"quant": jax.random.key(2)})
        return jnp.mean(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    params = nn.unbox(boxed)
    r_loss, r_grads = step(params, state, x)
    e_loss, e_grads = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(MoE(
        num_experts=4, top_k=2, d_ff=M.F, recipe=recipes.bf16(), activation="gelu", name="moe").apply(
        {"params": p}, x).astype(jnp.float32) ** 2)))(params, x)
    ps = state_shardings(boxed, mesh, rules)
    xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        placed = (jax.device_put(params, ps), state, jax.device_put(x, xs))
        compiled = jax.jit(jax.value_and_grad(loss)).lower(*placed).compile()
    got_loss, got_grads = compiled(*placed)
    frac = M.noise_fraction(recipe_name)
    _close(got_loss, r_loss, e_loss, "loss", frac)
    for (path, g), r, e in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(r_grads),
                               jax.tree.leaves(e_grads)):
        _close(g, r, e, f"grad {jax.tree_util.keystr(path)}", frac)
    moves = [c for c in collectives(compiled.as_text(), None)
             if c.kind in ("all-gather", "collective-permute", "all-to-all") and len(c.shape) == 3
             and c.shape[1:] in {(M.D, 2 * M.F), (2 * M.F, M.D), (M.F, M.D), (M.D, M.F), (M.D // 2, 2 * M.F),
                                 (M.F, M.D // 2)}]
    assert moves and all(c.dtype == "u8" and c.shape[0] == 2 for c in moves), moves


TRANSFORMER_CORE = {("dp2_fsdp2_tp2", "mxfp8", False), ("dp2_fsdp2_tp2", "nvfp4", True)}


@pytest.mark.parametrize("mesh_name, recipe_name, sp", [
    pytest.param(m, r, sp, marks=() if (m, r, sp) in TRANSFORMER_CORE else pytest.mark.slow)
    for m in MESHES for r in RECIPES for sp in (False, True) if not sp or "tp" in m])
def test_transformer_layers_sharded_step_equals_unsharded(mesh_name, recipe_name, sp):
    """2 TransformerLayers (jaxhq.layers) under jax.set_mesh + nn.logical_axis_rules: the layers pick up the
    quantized-gather hook from the mesh; params placed by shard_state from their logical boxes. With `sp`,
    sequence parallelism: the residual stream around the norms split on `length` over the tensor axis."""
    mesh, rules = make_mesh(**MESHES[mesh_name]), axis_rules(sequence_parallel=sp)
    boxed, params, batch = M.transformer_init(0)
    key = jax.random.key(1)
    ps = state_shardings(boxed, mesh, rules)  # boxes -> NamedShardings: the unboxed params' structure
    bs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
    placed = (jax.device_put(params, ps), jax.device_put(batch, (bs, bs)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        step = M.transformer_step(recipes.get(recipe_name), key)
        compiled = step.lower(*placed).compile()
    loss, grads = compiled(*placed)
    r_loss, r_grads = M.transformer_reference(recipe_name)
    e_loss, e_grads = M.transformer_reference("bf16")
    frac = M.noise_fraction(recipe_name, sequence_parallel=sp)
    _close(loss, r_loss, e_loss, "loss", frac)
    for (path, g), r, e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(r_grads),
                               jax.tree.leaves(e_grads)):
        _close(g, r, e, f"grad {jax.tree_util.keystr(path)}", frac)
    if MESHES[mesh_name].get("fsdp", 1) > 1:
        # 2 layers x 4 kernels (qkv, proj, fc1, fc2), each rowwise + columnwise data as uint8.
        assert len(_quantized_gathers(compiled.as_text())) >= 16
