"""Sharded quantize through custom_partitioning: on a 2x2 CPU mesh each shard is quantized in place (no
all-gather in the compiled program), outputs keep x's sharding (columnwise copies transposed) and equal the
unsharded call bit for bit, also where a sharding would split blocks (that axis is gathered) and where one
shard holds a NaN (the per-tensor amax is NaN everywhere), delayed scaling's kernel amax included, and an
activation's gradient quantized from h and dy. Runs in a subprocess so that it can ask for 4 CPU devices."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import jaxhq.ffi as jffi

pytestmark = pytest.mark.skipif(not jffi.available("cpu"), reason="jaxhq FFI extension not built")

SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from test_ffi_checks import HYBRID, SINGLE, applicable, compare, random_input
    from jaxhq.ffi.dispatch import quantize_copies
    from jaxhq.formats import MXFP8, NVFP4, Float8Block
    BLOCK = Float8Block((1, 128))
    assert len(jax.devices()) == 4
    mesh = jax.make_mesh((2, 2), ("a", "b"))
    for shape in [(256, 512), (130, 260)]:
        x = random_input(jax.random.key(1), shape, jnp.bfloat16)
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
        for q in SINGLE + HYBRID:
            if not applicable(q, shape):
                continue
            f = jax.jit(lambda x: quantize_copies(x, q, platform="cpu"))
            got = f(xs)
            assert compare(got, quantize_copies(x, q, platform="cpu"), q.label) == [], (shape, q.label)
            if shape == (256, 512):
                hlo = f.lower(xs).compile().as_text()
                assert "all-gather" not in hlo, q.label
                for a, s in got.items():
                    if s.quantizer.name != "identity":
                        want = ("a", "b") if a == "rowwise" else ("b", "a")
                        assert tuple(s.data.sharding.spec) == want, (q.label, a, s.data.sharding.spec)
    # stochastic rounding draws the numbers of each element's global position: sharded == unsharded
    x = random_input(jax.random.key(3), (256, 512), jnp.bfloat16)
    xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
    for q in (NVFP4(stochastic_rounding=True), NVFP4(rht=True, stochastic_rounding=True)):
        k = jax.random.key(4)
        got = jax.jit(lambda x: quantize_copies(x, q, key=k, platform="cpu"))(xs)
        assert compare(got, quantize_copies(x, q, key=k, platform="cpu"), q.label) == [], q.label
    # 96 = 3 x 32 columns in 2 shards of 48: MXFP8 blocks of 32 would straddle them, so K is gathered;
    # 128 rows in shards of 64 for 1x128 columnwise blocks: M is gathered. Results equal the unsharded call.
    for shape, spec, q in (((256, 96), jax.P(None, "b"), MXFP8()), ((128, 512), jax.P("a", "b"), BLOCK)):
        x = random_input(jax.random.key(2), shape, jnp.bfloat16)
        xs = jax.device_put(x, jax.NamedSharding(mesh, spec))
        got = jax.jit(lambda x: quantize_copies(x, q, platform="cpu"))(xs)
        assert compare(got, quantize_copies(x, q, platform="cpu"), q.label) == [], (shape, q.label)
    # a NaN on one shard: the per-tensor amax (FP8 current scaling, NVFP4's global) is NaN on every device, as
    # unsharded (the mesh max drops NaNs unless it reduces a NaN flag apart)
    x = random_input(jax.random.key(5), (256, 512), jnp.float32).at[200, 400].set(jnp.nan)
    xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
    for q in (SINGLE[0], NVFP4()):
        got = jax.jit(lambda x: quantize_copies(x, q, platform="cpu"))(xs)
        assert all(np.isnan(np.asarray(s.amax)) for s in got.values()), q.label
        assert compare(got, quantize_copies(x, q, platform="cpu"), q.label) == [], q.label
    # delayed scaling takes its amax from the quantize kernel of each shard, reduced over the mesh (NaN too):
    # no amax pass and nothing gathered
    from test_ffi_checks import DELAYED, state_for
    st = state_for(DELAYED)
    f = jax.jit(lambda x, st: quantize_copies(x, DELAYED, state=st, platform="cpu"))
    for x in (random_input(jax.random.key(6), (256, 512), jnp.bfloat16),
              random_input(jax.random.key(7), (256, 512), jnp.float32).at[10, 300].set(jnp.nan)):
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
        got = f(xs, st)
        assert compare(got, quantize_copies(x, DELAYED, state=st, platform="cpu"), "delayed") == []
        assert bool(np.isnan(np.asarray(got["rowwise"].amax))) == bool(np.isnan(np.asarray(x)).any())
        hlo = f.lower(xs, st).compile().as_text()
        assert "all-gather" not in hlo and "jaxhq_amax" not in hlo
    # an activation's gradient quantized from h and dy: rows sharded stay sharded (nothing gathered), a sharded
    # last axis is gathered (the gated halves), and the copies equal the unsharded launch's
    from jaxhq.ffi import primitives as FP
    act = FP.ACT_SILU | FP.GATED
    h = random_input(jax.random.key(8), (256, 512), jnp.bfloat16)
    dy = random_input(jax.random.key(9), (256, 256), jnp.bfloat16)
    want = quantize_copies(h, MXFP8(), platform="cpu", act_grad=(dy, act))
    f = jax.jit(lambda h, dy: quantize_copies(h, MXFP8(), platform="cpu", act_grad=(dy, act)))
    for spec in (jax.P("a", None), jax.P("a", "b")):
        hs, dys = (jax.device_put(t, jax.NamedSharding(mesh, spec)) for t in (h, dy))
        assert compare(f(hs, dys), want, "act_grad") == [], spec
        if spec == jax.P("a", None):
            assert "all-gather" not in f.lower(hs, dys).compile().as_text()
    print("OK")
''')


def test_sharded_quantize_stays_sharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    # the jaxhq this process imported (with its built extension: an installed package need not be the checkout)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.dirname(jffi.__file__)))  # the directory holding jaxhq/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, here, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=here, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
