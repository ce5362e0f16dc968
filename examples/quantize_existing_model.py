"""Quantize an existing Flax model without editing it: `jaxhq.quantize_model(model, recipe)` runs its nn.Dense
calls through the quantized dense op, with roles from the module paths, and takes the model's own params.

    python examples/quantize_existing_model.py
"""
import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxhq


class MLP(nn.Module):
    """An ordinary Flax model that knows nothing about jaxhq."""

    hidden: int = 128
    classes: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(self.hidden, name="fc1")(x))
        x = nn.gelu(nn.Dense(self.hidden, name="fc2")(x))
        return nn.Dense(self.classes, name="out")(x)


def task(key, n: int, dim: int = 64, classes: int = 16):
    """A synthetic classification task: labels from a fixed random linear teacher."""
    kt, kx = jax.random.split(key)
    teacher = jax.random.normal(kt, (dim, classes))
    x = jax.random.normal(kx, (n, dim))
    return x, jnp.argmax(x @ teacher, axis=-1)


def main(steps: int = 100, recipe: str = "mxfp8", hidden: int = 128) -> dict:
    model = MLP(hidden)
    x, y = task(jax.random.key(0), 512)
    params = model.init(jax.random.key(1), x[:1])["params"]  # the plain model's own params
    qmodel = jaxhq.quantize_model(model, recipe)
    plain = model.apply({"params": params}, x)
    quant = qmodel.apply({"params": params}, x)
    rel = float(jnp.linalg.norm(quant - plain) / jnp.linalg.norm(plain))
    print(f"{recipe} vs plain Flax output: relative difference {rel:.4f}")
    print(jaxhq.plan(recipe, [r for name in ("fc1", "fc2", "out")
                              for r in jaxhq.roles.gemm_roles(name).values()]))

    tx = optax.adam(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        def loss_fn(p):
            logits = qmodel.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(g, opt)
        return optax.apply_updates(params, upd), opt, loss

    losses = []
    for _ in range(steps):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    acc = float(jnp.mean(jnp.argmax(qmodel.apply({"params": params}, x), -1) == y))
    print(f"trained {steps} steps under {recipe}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, accuracy {acc:.2f}")
    return {"output_rel_diff": rel, "losses": losses, "accuracy": acc}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--recipe", default="mxfp8")
    a = p.parse_args()
    main(a.steps, a.recipe)
