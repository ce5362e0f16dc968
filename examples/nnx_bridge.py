"""jaxhq layers in Flax NNX through `nnx.bridge`: a linen TransformerLayer under a recipe becomes an NNX module
and trains with nnx.value_and_grad; under fp8_delayed its "quant_state" collection becomes NNX variables whose
forward slots advance in the forward pass and whose grad_output slots take their gradient (the next state).

Run: python examples/nnx_bridge.py [recipe]   (default mxfp8; try fp8_delayed, nvfp4, hybrid:mxfp8:nvfp4)
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import bridge
from flax.nnx.variablelib import variable_type_from_name

import jaxhq
from jaxhq.layers import QUANT_STATE, TransformerLayer

QuantState = variable_type_from_name(QUANT_STATE, allow_register=True)  # the NNX type of the linen collection


class Model(nnx.Module):
    """An NNX model holding one bridged jaxhq TransformerLayer and an NNX readout."""

    def __init__(self, recipe, d: int, rngs: nnx.Rngs):
        self.block = bridge.ToNNX(TransformerLayer(num_heads=2, d_ff=2 * d, recipe=recipe), rngs=rngs)
        self.out = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.block(x, mutable=[QUANT_STATE])).squeeze(-1)


def backward_states(grads: nnx.State) -> nnx.State:
    """The grad_output entries of the gradient w.r.t. the quant_state variables: their next values."""
    flat = {k: v for k, v in grads.flat_state() if "grad_output" in k}
    return nnx.State.from_flat_path(flat)


def main(recipe_name: str = "mxfp8", steps: int = 3, d: int = 32, tokens: int = 16):
    recipe = jaxhq.recipes.get(recipe_name)
    x = jax.random.normal(jax.random.key(0), (2, tokens, d))
    target = jnp.sin(x.sum(-1))
    # The params carry logical axis names for meshes; without a mesh, NNX must not shard them eagerly.
    with nnx.use_eager_sharding(False):
        model = Model(recipe, d, nnx.Rngs(params=0, quant=1))
        bridge.lazy_init(model.block, x)  # creates the linen params (and "quant_state" for delayed scaling)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, QuantState))

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            return jnp.mean((model(x) - target) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model)
        opt.update(model, grads.filter(nnx.Param))
        nnx.update(model, backward_states(grads.filter(QuantState)))
        return loss

    losses = [float(step(model, opt)) for _ in range(steps)]
    print(f"recipe {recipe.name}: losses {[round(v, 4) for v in losses]}")
    return losses, model


if __name__ == "__main__":
    main(*sys.argv[1:2])
