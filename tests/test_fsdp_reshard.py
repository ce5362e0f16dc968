"""FSDP's `reshard_after_forward` on 8 CPU devices (mesh data=2, fsdp=4): keeping the gathered columnwise copy
from the forward gives the same bits as re-gathering it in the backward, and the compiled HLO moves that gather
from the backward to the forward (the backward then gathers no weight); the option reaches the layers through
`fsdp_options`.

Needs 8 devices: test_sharding_launch.py runs this file in a subprocess with 8 host devices; here it skips.
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxhq
from jaxhq import recipes
from jaxhq.formats import quantize
from jaxhq.sharding import fsdp_options, make_mesh, mesh_axes, weight_sharding
from jaxhq.sharding.hlo import collectives


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                    "test_sharding_launch.py runs this file that way")


RECIPES = ["fp8_current", "mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4"]
TOKENS, D_IN, D_OUT = 256, 256, 512
PATH = "layers_0.up"


def _setup(recipe_name, reshard_after_forward):
    """(loss(x, kernel), placed x, placed kernel, the weight quantizer) of one fsdp-sharded dense."""
    mesh = make_mesh(data=2, fsdp=4)
    ws = weight_sharding(("embed", "mlp"), PATH, mesh=mesh, reshard_after_forward=reshard_after_forward)
    qs = recipes.get(recipe_name).dense_quantizers(PATH)

    def loss(x, k):
        y = jaxhq.dense(x, k, quantizers=qs, weight_sharding=ws, key=jax.random.key(7))
        return jnp.mean(y.astype(jnp.float32) ** 2)

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((TOKENS, D_IN)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((D_IN, D_OUT)) / D_IN ** .5, jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, mesh_axes(("batch", "embed"), None, mesh)))
    k = jax.device_put(k, NamedSharding(mesh, ws.kernel_spec()))
    return loss, x, k, qs.weight


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _copy_shapes(quantizer, k):
    """{copy: Counter of the 2D arrays' shapes (data, block scales)} of the weight's quantized copies, which
    is what a weight all-gather produces (the rowwise copy [out, in] and the columnwise [in, out] differ; 1x128
    and MXFP8 scales travel in the quantize launch's [blocks, rows], WeightSharding._storage)."""
    from jaxhq.ffi.dispatch import rows_inner_scales

    def gathered(s, a):
        return a.shape[::-1] if a is s.scale_inv and rows_inner_scales(s) else a.shape

    qt = jax.eval_shape(lambda k: quantize(k.T, quantizer), k)
    return {axis: collections.Counter(gathered(s, a) for a in (s.data, s.scale_inv) if a is not None and a.ndim == 2)
            for axis, s in (("rowwise", qt.rowwise), ("columnwise", qt.columnwise))}


def _gathered(hlo):
    return collections.Counter(c.shape for c in collectives(hlo, "all-gather"))


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_keeping_the_gathered_copy_is_bit_identical_and_moves_the_gather_to_the_forward(recipe_name):
    steps, hlos = {}, {}
    for keep in (False, True):
        loss, x, k, wq = _setup(recipe_name, reshard_after_forward=not keep)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, k).compile()
        steps[keep] = jax.tree.leaves(step(x, k))
        # The same step split at the VJP: the forward returns the residuals, the backward consumes them.
        fwd = jax.jit(lambda x, k: jax.vjp(loss, x, k)).lower(x, k).compile()
        _, vjp_fn = fwd(x, k)
        bwd = jax.jit(lambda f, g: f(g)).lower(vjp_fn, jnp.float32(1)).compile()
        hlos[keep] = step.as_text(), fwd.as_text(), bwd.as_text()
    for a, b in zip(steps[False], steps[True]):  # loss, dx, dw
        assert a.shape == b.shape and np.array_equal(_bits(a), _bits(b)), recipe_name
    shapes = _copy_shapes(wq, k)
    row, col = shapes["rowwise"], shapes["columnwise"]
    assert row and col
    _, fwd, bwd = hlos[False]  # reshard_after_forward=True (the default): the backward re-gathers
    assert _gathered(fwd) == row and _gathered(bwd) == col, (recipe_name, _gathered(fwd), _gathered(bwd))
    _, fwd, bwd = hlos[True]  # reshard_after_forward=False: both copies gathered in the forward, none after
    assert _gathered(fwd) == row + col and not _gathered(bwd), (recipe_name, _gathered(fwd), _gathered(bwd))
    # In one step the weight moves as often either way: the option changes when, not how much.
    assert _gathered(hlos[False][0]) == _gathered(hlos[True][0]) == row + col
    assert all(c.dtype == "u8" for c in collectives(hlos[True][0], "all-gather"))


def test_fsdp_options_reaches_weight_sharding_and_the_layers():
    from jaxhq.layers.dense import _weight_sharding
    mesh = make_mesh(data=2, fsdp=4)
    assert weight_sharding(("embed", "mlp"), mesh=mesh).reshard_after_forward  # the default
    with fsdp_options(reshard_after_forward=False):
        assert not weight_sharding(("embed", "mlp"), mesh=mesh).reshard_after_forward
        assert weight_sharding(("embed", "mlp"), mesh=mesh, reshard_after_forward=True).reshard_after_forward
        with fsdp_options(reshard_after_forward=True):
            assert weight_sharding(("embed", "mlp"), mesh=mesh).reshard_after_forward
        with jax.set_mesh(mesh):  # the layers' hook: current mesh, current rules, current FSDP options
            ws = _weight_sharding(("embed", "mlp"), PATH)
        assert not ws.reshard_after_forward and ws.spec[0] == ("fsdp",)
        exp = jaxhq.sharding.expert_sharding(("expert", "embed", "mlp"), mesh=make_mesh(fsdp=4, expert=2))
        assert not exp.kernel.reshard_after_forward
    assert weight_sharding(("embed", "mlp"), mesh=mesh).reshard_after_forward  # restored on exit
