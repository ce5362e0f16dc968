"""Sharded == unsharded on 2 GPUs in one process: the 2-layer step of test_sharding_model on an FSDP mesh, a
tensor-parallel mesh and an expert mesh (layer 1 a 2-expert grouped dense), under each recipe, against the same
step on one GPU; weights gathered as uint8, the FFI GEMMs partitioned (no activation all-gathered).
Run: python -m pytest tests/test_sharding_gpu.py -m gpu -q (skips without 2 GPUs)."""
import jax
import pytest

import test_sharding_model as M
from jaxhq import recipes
from jaxhq.sharding import make_mesh
from jaxhq.sharding.hlo import collectives

pytestmark = pytest.mark.gpu

RECIPES = ["fp8_current", "mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4"]
MESHES = {"fsdp2": dict(fsdp=2), "tp2": dict(tensor=2), "expert2": dict(expert=2)}


def _gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_two_gpu_step_equals_one_gpu(recipe_name, mesh_name):
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs, found {len(gpus)}")
    mesh = make_mesh(**MESHES[mesh_name], devices=gpus[:2])
    experts = mesh_name == "expert2"
    params, batch = M.init_params(0, experts)
    jitted, ps, bs = M.sharded_step(recipes.get(recipe_name), jax.random.key(1), mesh, params)
    placed = (jax.device_put(params, ps), jax.device_put(batch, bs))
    compiled = jitted.lower(*placed).compile()
    loss, grads, _ = compiled(*placed)
    r_loss, r_grads, _ = M.reference(recipe_name, experts)
    e_loss, e_grads, _ = M.reference("bf16", experts)
    frac = M.noise_fraction(recipe_name)
    M.assert_close(loss, r_loss, e_loss, "loss", frac)
    for (path, g), r, e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(r_grads),
                               jax.tree.leaves(e_grads)):
        M.assert_close(g, r, e, f"grad {jax.tree_util.keystr(path)}", frac)
    gathers = collectives(compiled.as_text())
    weight_shapes = {(M.D, M.F // mesh.shape["tensor"]), (M.F // mesh.shape["tensor"], M.D)}
    bad = [c for c in gathers if c.shape in weight_shapes and c.dtype != "u8"]
    assert not bad, f"weight all-gathers in high precision: {bad}"
    if mesh.shape["fsdp"] > 1:
        assert sum(c.dtype == "u8" for c in gathers) >= 8, gathers
    if not experts:
        assert "jaxhq_gemm" in compiled.as_text(), "the GEMMs did not run the FFI kernels"
        bad = M.activation_gathers(compiled.as_text(), mesh.shape["tensor"])
        assert not bad, f"activations gathered: {bad}"
