"""Sequence parallelism (`axis_rules(sequence_parallel=True)`) on 8 CPU devices, mesh (2 data, 2 fsdp, 2 tensor):
column-parallel dense ops quantize the length-split residual stream where it lies and all-gather the quantized
bytes; row-parallel ones (and the column-parallel dgrads) reduce-scatter onto the length split. Results equal the
unsharded ones up to fp32 summation order, and the compiled HLO moves no activation in high precision.

Shapes: 12 sequences of 256 tokens (3 per batch shard, 128 per length shard: whole blocks of every format, FP8
blockwise's 128 included), d 256, 4 heads (2 kv heads), d_ff 512. Every feature dim is a power of two and the
token count per batch shard (3 x 256) is not, so an array whose element count is divisible by 3 is an activation
(or its scales). Needs 8 devices: test_sharding_launch.py runs this file that way.
"""
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import test_sharding_model as M
from jaxhq import recipes
from jaxhq.formats import NVFP4, Hybrid, init_state
from jaxhq.layers.state import merge_quant_state
from jaxhq.ops import dense
from jaxhq.sharding import axis_rules, make_mesh, mesh_axes, state_shardings, weight_sharding
from jaxhq.sharding.hlo import collectives
from jaxhq.sharding.sequence import SequencePlan, sequence_plan


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                    "test_sharding_launch.py runs this file that way")


B, L, D, F = 12, 256, 256, 512
STACK = dict(heads=4, kv_heads=2, d_ff=F)
SP = axis_rules(sequence_parallel=True)
RECIPES = ["bf16", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4"]
HIGH = ("f32", "bf16", "f16")
A = B // 4 * L * D  # elements of one activation [B, L, D] on a device after the gather (3 sequences)


def _mesh():
    return make_mesh(data=2, fsdp=2, tensor=2)


def _act(hlo, kind):
    """Collectives of `kind` that move activations (element count divisible by 3, see the module docstring)."""
    return [c for c in collectives(hlo, kind) if math.prod(c.shape) % 3 == 0]


def _without_stochastic_rounding(recipe):
    """`recipe` with round-to-nearest NVFP4 gradients: the copies of a length-split grad_output are quantized in
    shard-major order, so stochastic rounding draws other (equally distributed) random numbers than unsharded."""
    def plain(q):
        if isinstance(q, Hybrid):
            return Hybrid(plain(q.rowwise), plain(q.columnwise))
        return dataclasses.replace(q, stochastic_rounding=False) if isinstance(q, NVFP4) else q
    return recipes.CustomRecipe(lambda role: plain(recipe.quantizer(role)), name=recipe.name)


def test_plan_classifies_column_and_row_parallel_ops():
    """Only the length-split rules make a plan: column-parallel (kernel out dim on tensor) gathers its input and
    reduce-scatters its dgrad, row-parallel reduce-scatters its output and gathers its grad_output."""
    mesh, qs = _mesh(), recipes.mxfp8().dense_quantizers("l")
    col = sequence_plan(weight_sharding(("embed", "mlp"), "l", mesh=mesh, rules=SP), (B, L, D), qs, F)
    row = sequence_plan(weight_sharding(("mlp", "embed"), "l", mesh=mesh, rules=SP), (B, L, F), qs, D)
    assert col.column and col.gathers("input") and col.scatters("dgrad") and not col.scatters("forward")
    assert not row.column and row.gathers("grad_output") and row.scatters("forward") and not row.gathers("input")
    assert (col.axes, col.batch, col.lead) == (("tensor",), ("data", "fsdp"), (B, L))
    assert sequence_plan(weight_sharding(("embed", "mlp"), "l", mesh=mesh, rules=axis_rules()), (B, L, D), qs,
                         F) is None  # no length split: the op is as before
    assert sequence_plan(weight_sharding(("embed", None), "l", mesh=mesh, rules=SP), (B, L, D), qs, F) is None
    assert sequence_plan(weight_sharding(("embed", "mlp"), "l", mesh=mesh, rules=SP), (B * L, D), qs, F) is None


# -- the dense ops: sharded == unsharded up to the GEMMs' summation order ----------------------------------------
def _dense_pair(x, w1, g1, h, w2, g2, recipe, mesh):
    """A column-parallel dense x [B, L, D] -> [B, L, F] and a row-parallel one h [B, L, F] -> [B, L, D]: their
    outputs and the gradients of both inputs (cotangents g1, g2), then the next delayed-scaling states."""
    out, states = [], []
    for i, (a, w, g, axes) in enumerate(((x, w1, g1, ("embed", "mlp")), (h, w2, g2, ("mlp", "embed")))):
        ws = None if mesh is None else weight_sharding(axes, f"layers_0.d{i}", mesh=mesh, rules=SP)
        qs = recipe.dense_quantizers(f"layers_0.d{i}")
        st = {s: init_state(getattr(qs, s)) for s in ("input", "weight", "grad_output")}  # delayed: scale 1
        st = {s: v for s, v in st.items() if v is not None}
        (y, new), vjp = jax.vjp(lambda a, w, st: dense(a, w, quantizers=qs, weight_sharding=ws, states=st,
                                                       key=jax.random.key(i), return_state=True), a, w, st)
        da, dw, d_st = vjp((g, jax.tree.map(jnp.zeros_like, new)))
        out += [y, da, dw]
        states += [new, d_st]  # the cotangent of the grad_output state is its next value
    return out, states


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_dense_ops_equal_unsharded_up_to_summation_order(recipe_name):
    """Forward, dgrad and wgrad of a column- and a row-parallel dense under sequence parallelism, against the
    unsharded ops on identical inputs. The quantized operands are bit-identical (per-shard quantization with
    global amaxes, no block across shards; stochastic rounding off, see `_without_stochastic_rounding`), so
    the outputs may differ only by summation order: within the rigorous bound of M.order_bound. The next
    delayed-scaling states (amaxes of the inputs, weights and gradients) are bit-identical."""
    recipe = _without_stochastic_rounding(recipes.get(recipe_name))
    mesh = _mesh()
    rng = np.random.default_rng(7)
    shapes = ((B, L, D), (D, F), (B, L, F), (B, L, F), (F, D), (B, L, D))
    args = [jnp.asarray(rng.standard_normal(s) / (s[0] ** .5 if len(s) == 2 else 1), jnp.float32) for s in shapes]
    ref, ref_states = jax.jit(functools.partial(_dense_pair, recipe=recipe, mesh=None))(*args)
    names = [("batch", "length", "embed"), ("embed", "mlp"), ("batch", "length", "mlp"),
             ("batch", "length", "mlp"), ("mlp", "embed"), ("batch", "length", "embed")]
    placed = [jax.device_put(a, NamedSharding(mesh, mesh_axes(n, SP, mesh))) for a, n in zip(args, names)]
    got, got_states = jax.jit(functools.partial(_dense_pair, recipe=recipe, mesh=mesh))(*placed)
    x, w1, g1, h, w2, g2 = (np.asarray(a).reshape(-1, a.shape[-1]) for a in args)
    bounds = [M.order_bound(x, w1), M.order_bound(g1, w1.T), M.order_bound(x.T, g1),
              M.order_bound(h, w2), M.order_bound(g2, w2.T), M.order_bound(h.T, g2)]
    for name, a, b, bound in zip(["y1", "dx1", "dw1", "y2", "dx2", "dw2"], got, ref, bounds):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).reshape(bound.shape)
        assert np.all(diff <= bound), f"{name}: max diff/bound {np.max(diff / bound):.3g}"
    assert bool(jax.tree.leaves(ref_states)) == (recipe_name == "fp8_delayed")
    for a, b in zip(jax.tree.leaves(got_states), jax.tree.leaves(ref_states)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_token_blocks_across_shards_fall_back_with_a_warning():
    """32 tokens per sequence over 2 tensor ranks: 16 per shard, half an MXFP8 block of the columnwise copy. The
    input takes the partitioner's high-precision path (a warning names role, shape and format) and the result
    is still the unsharded one."""
    mesh, recipe = _mesh(), recipes.mxfp8()
    x, w = jnp.ones((4, 32, D)), jnp.ones((D, F)) / D
    ws = weight_sharding(("embed", "mlp"), "layers_2.mlp.fc1", mesh=mesh, rules=SP)
    qs = recipe.dense_quantizers("layers_2.mlp.fc1")
    with pytest.warns(UserWarning, match=r"input linear/input@layers_2\.mlp\.fc1: its columnwise copy "
                                         r"\[256, 128\] \(mxfp8_e4m3\) has blocks of 32 tokens.*16 tokens"):
        plan = sequence_plan(ws, x.shape, qs, F)
    assert plan.column and not plan.gathers("input") and plan.scatters("dgrad")
    xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), SP, mesh))
    with pytest.warns(UserWarning, match="straddle"):
        got = jax.jit(lambda x, w: dense(x, w, quantizers=qs, weight_sharding=ws))(jax.device_put(x, xs), w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dense(x, w, quantizers=qs)))


# -- two TransformerLayers: the training step ------------------------------------------------------------------
def _step(recipe):
    """jit of (params, quant_state, batch) -> ((loss, forward-updated quant_state), (grads, grad of the state))."""
    model = M.transformer_stack(recipe, **STACK)

    def loss(p, qst, batch):
        out, new = model.apply({"params": p, "quant_state": qst}, batch[0], rngs={"quant": jax.random.key(1)},
                               mutable=["quant_state"])
        return jnp.mean((out.astype(jnp.float32) - batch[1]) ** 2), new.get("quant_state", {})

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.lru_cache(maxsize=None)
def _setup():
    return M.transformer_init(0, (B, L, D), **STACK)


@functools.lru_cache(maxsize=None)
def _reference(recipe_name):
    """(quant state to start from, unsharded loss, grads). Delayed scaling starts from the state after one
    unsharded step, so its scales are those of these tensors rather than the initial 1.0."""
    _, params, batch = _setup()
    recipe, step = recipes.get(recipe_name), _step(recipes.get(recipe_name))
    state = nn.unbox(M.transformer_stack(recipe, **STACK).init(jax.random.key(0), batch[0]).get("quant_state", {}))
    if state:
        (_, fwd), (_, bwd) = step(params, state, batch)
        state = merge_quant_state(fwd, bwd)
    (loss, _), (grads, _) = step(params, state, batch)
    return jax.tree.map(np.asarray, (state, loss, grads))


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_transformer_step_equals_unsharded_and_moves_quantized_activations(recipe_name):
    """Loss and gradients of 2 TransformerLayers under sequence parallelism equal the unsharded step's, within
    M.assert_close's justified bound (the quantization noise fraction: an ulp difference that one GEMM's
    summation order makes may flip a code downstream; 1.5 where the gradients round stochastically, see
    M.noise_fraction: the dense-op test above checks those ops without it).

    HLO: for a quantized recipe no activation is all-gathered in high precision (only FP8 blockwise's fp32
    block scales, 1/128 of the elements); the gathered activations are uint8 codes: per layer the inputs of qkv
    and fc1 (rowwise in the forward, columnwise in the backward) and the grad_outputs of proj and fc2 (both),
    only the rowwise copies for per-tensor FP8, whose columnwise copies are their transposes;
    the row-parallel outputs and the column-parallel dgrads are reduce-scattered (4 per layer) and no
    activation is all-reduced."""
    boxed, params, batch = _setup()
    state, r_loss, r_grads = _reference(recipe_name)
    _, e_loss, e_grads = _reference("bf16")
    mesh, recipe = _mesh(), recipes.get(recipe_name)
    ps = state_shardings(boxed, mesh, SP)
    xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), SP, mesh))
    placed = (jax.device_put(params, ps), state, jax.device_put(batch, (xs, xs)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(SP):
        compiled = _step(recipe).lower(*placed).compile()
    (loss, _), (grads, _) = compiled(*placed)
    frac = M.noise_fraction(recipe_name, sequence_parallel=True)
    M.assert_close(loss, r_loss, e_loss, "loss", frac)
    for (path, g), r, e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(r_grads),
                               jax.tree.leaves(e_grads)):
        M.assert_close(g, r, e, f"grad {jax.tree_util.keystr(path)}", frac)

    hlo = compiled.as_text()
    gathers = _act(hlo, "all-gather")
    if recipe_name == "bf16":
        assert gathers and {c.dtype for c in gathers} == {"f32"}, gathers  # nothing to quantize: f32 model
    else:
        wide = [c for c in gathers if c.dtype in HIGH and math.prod(c.shape) * 128 > A]
        assert not wide, f"activations all-gathered in high precision: {wide}"
        qs = recipe.dense_quantizers("layers_0.mlp.fc1")
        copies = sum(1 if SequencePlan.transposes(q) else 2 for q in (qs.input, qs.grad_output))
        codes = [c for c in gathers if c.dtype == "u8" and math.prod(c.shape) * 2 >= A]
        assert len(codes) == 2 * 2 * copies, gathers  # 2 layers x 2 ops (one column-, one row-parallel)
    scattered = _act(hlo, "reduce-scatter")
    assert len(scattered) == 8 and all(math.prod(c.shape) == A // 2 for c in scattered), scattered
    assert not _act(hlo, "all-reduce"), _act(hlo, "all-reduce")
