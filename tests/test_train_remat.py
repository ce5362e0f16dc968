"""Activation recompute around TransformerLayers: same gradients with and without remat, and a policy that
keeps only the quantized residuals of the dense ops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhq.layers import TransformerLayer
from jaxhq.train import data, model as M, remat, state as S

CFG = M.preset("micro")


def _grads(recipe, policy, batch):
    st = S.create(M.GPT(CFG.replace(remat=policy), S.named_recipe(recipe)), S.make_optimizer(1e-2, 20, 2))
    loss, _, g = jax.jit(S.loss_and_grads)(st, batch)
    return float(loss), g


@pytest.mark.parametrize("recipe", ["fp8_delayed"])
def test_remat_gives_the_same_gradients(recipe):
    ds = data.load(data.DataConfig(batch_size=2, seq_len=CFG.seq_len, max_bytes=300_000, chunk=1024))
    batch = ds.train_batch(0)
    loss0, g0 = _grads(recipe, "none", batch)
    for policy in ("full", "quantized", "offload"):
        loss, g = _grads(recipe, policy, batch)
        assert loss == loss0
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown remat policy 'some'"):
        remat.remat_layer(TransformerLayer, "some")


BATCH, SEQ, D, D_FF = 2, 32, 32, 64  # the layer of _residuals


def _residuals(policy):
    from jax._src.ad_checkpoint import saved_residuals
    layer = TransformerLayer(num_heads=2, d_ff=D_FF, recipe=S.named_recipe("mxfp8"))
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, D))
    params = layer.init(jax.random.key(1), x)

    def f(p, x):
        return jnp.sum(layer.apply(p, x) ** 2)

    return saved_residuals(jax.checkpoint(f, policy=policy), params, x)


def test_quantized_policy_saves_only_quantized_copies():
    from jaxhq.formats import MXFP8
    from jaxhq.ops.gemm import saved_decoded
    saved = [(aval, why) for aval, why in _residuals(remat.quantized_residuals_policy())
             if "argument" not in str(why)]
    assert saved
    # Where the GEMMs dequantize (Hopper, the CPU handlers), each dense op saves its input's columnwise copy
    # decoded: the quantized values as bf16, [K, tokens] (ops.gemm.saved_decoded).
    decoded_input = saved_decoded(MXFP8(), "input", MXFP8()) != ()
    decoded = []
    for aval, why in saved:
        assert remat.QUANTIZED_RESIDUAL in str(why), (aval, why)
        low = aval.dtype.itemsize == 1  # FP8 data, packed FP4, E8M0 scales
        if not low and aval.size > BATCH * SEQ * D // 32 * 2:  # else only small fp32 scales / amaxes
            assert decoded_input and aval.dtype == jnp.bfloat16 and aval.shape[-1] == BATCH * SEQ, (aval, why)
            decoded.append(aval)
    # the four dense ops' inputs (qkv, out, fc1: K = D; fc2: K = D_FF), decoded or not at all
    assert sorted(a.shape[0] for a in decoded) == ([D, D, D, D_FF] if decoded_input else [])
    saved_bytes = sum(a.size * a.dtype.itemsize for a, _ in saved)
    everything = _residuals(jax.checkpoint_policies.everything_saveable)
    plain = [(a, w) for a, w in everything if "argument" not in str(w)]
    assert saved_bytes < sum(a.size * a.dtype.itemsize for a, _ in plain) / 2
