"""Orbax checkpoints: bit-identical resume, restore under another recipe, clear errors for mismatches."""
import jax
import numpy as np
import pytest

from jaxhq import recipes
from jaxhq.train import checkpoint as C, data, model as M, state as S

CFG = M.preset("micro")


@pytest.fixture(scope="module")
def ds():
    return data.load(data.DataConfig(batch_size=2, seq_len=CFG.seq_len, max_bytes=300_000, chunk=1024,
                                     val_every=10))


def make(recipe, cfg=CFG):
    return S.create(M.GPT(cfg, S.named_recipe(recipe)), S.make_optimizer(1e-2, 20, 2))


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def run(st, ds, start, n):
    losses = []
    for i in range(start, start + n):
        st, m = S.train_step(st, ds.train_batch(i))
        losses.append(float(m["loss"]))
    return st, losses


@pytest.mark.parametrize("recipe", ["fp8_delayed", "nvfp4"])
def test_resume_is_bit_identical(tmp_path, ds, recipe):
    st, _ = run(make(recipe), ds, 0, 3)
    C.save(tmp_path, st, extra={"note": "x"})
    assert C.latest_step(tmp_path) == 3
    straight, want = run(st, ds, 3, 3)
    restored, meta = C.restore(tmp_path, make(recipe))
    assert meta["recipe"] == recipe and meta["note"] == "x" and int(restored.step) == 3
    assert leaves_equal(restored.quant_state, st.quant_state) and leaves_equal(restored.opt_state, st.opt_state)
    assert leaves_equal(restored.weight_amax, st.weight_amax)  # the restored kernels' (not the template state's)
    resumed, got = run(restored, ds, 3, 3)
    assert got == want
    assert leaves_equal(resumed.params, straight.params) and leaves_equal(resumed.quant_state, straight.quant_state)


def test_restore_under_another_recipe_requantizes(tmp_path, ds):
    st, _ = run(make("fp8_delayed"), ds, 0, 2)
    C.save(tmp_path, st)
    r, _ = C.restore(tmp_path, make("mxfp8"))
    assert r.recipe.name == "mxfp8" and r.quant_state == {} and int(r.step) == 2
    assert leaves_equal(r.params, st.params) and leaves_equal(r.opt_state, st.opt_state)
    back, _ = C.restore(tmp_path, make("fp8_delayed"))
    assert leaves_equal(back.quant_state, st.quant_state)
    # mxfp8 checkpoint into fp8_delayed: fresh delayed-scaling state, training goes on
    C.save(tmp_path / "m", r)
    d, _ = C.restore(tmp_path / "m", make("fp8_delayed"))
    assert leaves_equal(d.quant_state, make("fp8_delayed").quant_state)
    _, losses = run(d, ds, 2, 2)
    assert np.all(np.isfinite(losses))


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path, ds):
    C.save(tmp_path, make("bf16"))
    with pytest.raises(C.CheckpointError, match="another model: d_model: checkpoint 32 vs model 48"):
        C.restore(tmp_path, make("bf16", CFG.replace(d_model=48)))
    with pytest.raises(C.CheckpointError, match="num_layers"):
        C.restore(tmp_path, make("bf16", CFG.replace(num_layers=2)))
    with pytest.raises(C.CheckpointError, match="no checkpoint"):
        C.restore(tmp_path / "empty", make("bf16"))


def test_same_recipe_name_with_other_state_is_a_clear_error(tmp_path):
    C.save(tmp_path, make("fp8_delayed"))
    other = S.create(M.GPT(CFG, recipes.fp8_delayed(history_len=16)), S.make_optimizer(1e-2, 20, 2))
    with pytest.raises(C.CheckpointError, match="quantizer state does not match"):
        C.restore(tmp_path, other)


SHARDED = """
import sys, jax, numpy as np
from jaxhq.sharding import make_mesh
from jaxhq.train import checkpoint as C, data, model as M, sharded, state as S
mesh = make_mesh(data=2, fsdp=2, tensor=2)
cfg = M.preset("tiny").replace(num_layers=1)
ds = data.load(data.DataConfig(batch_size=8, seq_len=cfg.seq_len, max_bytes=300_000, chunk=1024))
make = lambda: sharded.shard_train_state(S.create(M.GPT(cfg, S.named_recipe("fp8_delayed")), S.make_optimizer()), mesh)
st = make()
with sharded.mesh_context(mesh):
    st, _ = S.train_step(st, sharded.shard_batch(ds.train_batch(0), mesh))
C.save(sys.argv[1], st)
r, _ = C.restore(sys.argv[1], make())
k0, k1 = st.params["layers_0"]["mlp"]["fc1"]["kernel"], r.params["layers_0"]["mlp"]["fc1"]["kernel"]
assert k1.sharding == k0.sharding and tuple(k1.sharding.spec) == ("fsdp", "tensor"), k1.sharding
for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(r)):
    assert a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b))
with sharded.mesh_context(mesh):
    _, m0 = S.train_step(st, sharded.shard_batch(ds.train_batch(1), mesh))
    _, m1 = S.train_step(r, sharded.shard_batch(ds.train_batch(1), mesh))
assert float(m0["loss"]) == float(m1["loss"])
print("OK")
"""


def test_sharded_state_saves_and_restores_on_a_mesh(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    r = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "ck")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
