"""A per-layer role factory: the first and last transformer layers and the LM head in MXFP8, the layers in
between in NVFP4, attention in high precision. Prints the plan, then trains the GPT a few steps.

    python examples/custom_factory.py --steps 50
    cd examples && jaxhq train --recipe custom_factory:tiny_recipe   # the same factory from the CLI
"""
import argparse

import jaxhq
from jaxhq import MXFP8, NVFP4, Identity, QuantizerRole
from jaxhq.recipes import layer_index
from jaxhq.train import data, model, state


def make_factory(num_layers: int):
    """role -> quantizer, by the layer index in the role's module path ("layers_3.mlp.fc1")."""
    edge = MXFP8("e4m3")
    middle = {"input": NVFP4(rht=True), "weight": NVFP4(block_2d=True),
              "grad_output": NVFP4(rht=True, stochastic_rounding=True)}

    def factory(role: QuantizerRole):
        if role.module_type == "dpa":
            return Identity()
        i = layer_index(role.name)
        if i is None or i in (0, num_layers - 1):  # lm_head has no layer index: keep it in MXFP8
            return edge
        return middle[role.tensor_type]

    return factory


def tiny_recipe():
    """For `jaxhq train --recipe custom_factory:tiny_recipe` (the tiny preset has 2 layers)."""
    return jaxhq.CustomRecipe(make_factory(model.preset("tiny").num_layers), name="edges_mxfp8_middle_nvfp4")


def main(model_name: str = "tiny", num_layers: int = 4, steps: int = 30, batch_size: int = 8) -> dict:
    cfg = model.preset(model_name).replace(num_layers=num_layers)
    recipe = jaxhq.CustomRecipe(make_factory(num_layers), name="edges_mxfp8_middle_nvfp4")
    gpt = model.GPT(cfg, recipe)
    print(jaxhq.plan(recipe, gpt, model.example_tokens(cfg, 1)))
    ds = data.load(data.DataConfig(batch_size=batch_size, seq_len=cfg.seq_len))
    st = state.create(gpt, state.make_optimizer(steps=steps, warmup=max(1, steps // 10)))
    val = ds.val_batches(2)
    before = state.evaluate(st, val)
    for i in range(steps):
        st, metrics = state.train_step(st, ds.train_batch(i))
    after = state.evaluate(st, val)
    print(f"validation loss {before:.3f} -> {after:.3f} after {steps} steps")
    return {"val_before": before, "val_after": after, "recipe": recipe}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    main(a.model, a.layers, a.steps)
