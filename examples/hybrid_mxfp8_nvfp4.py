"""MXFP8 forward, NVFP4 backward: each tensor keeps one copy per direction, in its own format.

The forward GEMM reads MXFP8 copies (so the forward pass is bit for bit the MXFP8 recipe's), dgrad and wgrad
read NVFP4 copies (16x16 weight tiles, Hadamard-transformed wgrad operands, stochastically rounded gradients).

    python examples/hybrid_mxfp8_nvfp4.py
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxhq
from jaxhq.train import data, model, state


def one_gemm(m: int = 64, k: int = 64, n: int = 32, seed: int = 0) -> dict:
    """One dense op under hybrid and under plain MXFP8: same output, different (NVFP4) gradients."""
    kx, kw, kdy, kq = jax.random.split(jax.random.key(seed), 4)
    x, w = jax.random.normal(kx, (m, k)), jax.random.normal(kw, (k, n)) / 8
    dy = jax.random.normal(kdy, (m, n))
    out = {}
    for name in ("hybrid:mxfp8:nvfp4", "mxfp8"):
        qs = jaxhq.recipes.get(name).dense_quantizers("demo")
        y, vjp = jax.vjp(lambda x, w: jaxhq.dense(x, w, quantizers=qs, key=kq), x, w)
        out[name] = (y, *vjp(dy))
    exact_dw = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    h, mx = out["hybrid:mxfp8:nvfp4"], out["mxfp8"]
    return {"forward_equal": bool(jnp.array_equal(h[0], mx[0])),
            "dw_rel_err_hybrid": float(np.linalg.norm(h[2] - exact_dw) / np.linalg.norm(exact_dw)),
            "dw_rel_err_mxfp8": float(np.linalg.norm(mx[2] - exact_dw) / np.linalg.norm(exact_dw))}


def main(model_name: str = "tiny", steps: int = 30, batch_size: int = 8) -> dict:
    recipe = jaxhq.hybrid(forward="mxfp8", backward="nvfp4")
    g = one_gemm()
    print(f"one GEMM: forward identical to MXFP8: {g['forward_equal']}; wgrad relative error "
          f"{g['dw_rel_err_hybrid']:.3f} (NVFP4 backward) vs {g['dw_rel_err_mxfp8']:.3f} (MXFP8 backward)")
    cfg = model.preset(model_name)
    gpt = model.GPT(cfg, recipe)
    print(jaxhq.plan(recipe, gpt, model.example_tokens(cfg, 1)))
    ds = data.load(data.DataConfig(batch_size=batch_size, seq_len=cfg.seq_len))
    losses = {}
    for rec in (recipe, jaxhq.bf16()):
        st = state.create(model.GPT(cfg, rec), state.make_optimizer(steps=steps, warmup=max(1, steps // 10)))
        for i in range(steps):
            st, _ = state.train_step(st, ds.train_batch(i))
        losses[rec.name] = state.evaluate(st, ds.val_batches(2))
    print("validation loss after", steps, "steps:", {k: round(v, 4) for k, v in losses.items()})
    return {**g, "val_loss": losses}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    main(a.model, a.steps)
