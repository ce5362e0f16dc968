"""jaxhq's recipes against the FP8 a Flax user already has, on the same MLP stack, forward + backward.

The stack: 2 blocks of (up projection, GELU, down projection, residual), bf16 activations, fp32 weights.
Variants: Flax bf16 (`nn.Dense`), Flax FP8 (`nn.Dense(dot_general_cls=nn.Fp8DirectDotGeneralOp)`: delayed
scaling, quantization left to XLA, which fuses the casts into the neighbouring ops) and jaxhq's `Dense` under
each recipe. Timed: one jitted value-and-grad over the weights, the input and the scaling state, back to back,
after 3 steps that bring the delayed-scaling states (Flax's and jaxhq's) to the scales training would use;
every variant of a shape is compiled first, then all are timed in turn for --rounds rounds (median per variant).

    python benchmarks/peer_fp8.py                      # on a GPU: both shapes of the issue
    python benchmarks/peer_fp8.py --shapes 1024x3584x4096 --recipes fp8_delayed,mxfp8
"""
from __future__ import annotations

import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser, print_table, time_back_to_back, write_json  # noqa: E402

from jaxhq.layers import Dense  # noqa: E402
from jaxhq.layers.state import QUANT_STATE, merge_quant_state  # noqa: E402
from jaxhq.recipes import get as get_recipe  # noqa: E402

SHAPES = "4096x14336x8192,1024x3584x4096"  # d_model x d_ff x tokens
RECIPES = "fp8_delayed,fp8_current,fp8_block,mxfp8,nvfp4"


class Stack(nn.Module):
    d_ff: int
    variant: str  # "flax_bf16", "flax_fp8" or a jaxhq recipe name

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            if self.variant.startswith("flax"):
                extra = {"dot_general_cls": nn.Fp8DirectDotGeneralOp} if self.variant == "flax_fp8" else {}
                up = nn.Dense(self.d_ff, dtype=jnp.bfloat16, name=f"up_{i}", **extra)
                down = nn.Dense(x.shape[-1], dtype=jnp.bfloat16, name=f"down_{i}", **extra)
            else:
                recipe = get_recipe(self.variant)
                up = Dense(self.d_ff, recipe=recipe, dtype=jnp.bfloat16, name=f"up_{i}")
                down = Dense(x.shape[-1], recipe=recipe, dtype=jnp.bfloat16, name=f"down_{i}")
            x = x + down(jax.nn.gelu(up(x)))
        return x


OVERWRITE = "_overwrite_with_gradient"  # Flax FP8's scaling state: its gradient is the next state


def step_fn(model: Stack):
    """value-and-grad of a scalar loss over every variable collection, with the mutated collections as aux
    (Flax FP8 and jaxhq's delayed scaling return their next scaling state as a gradient or as a mutated
    collection)."""
    def loss(v, x):
        y, mutated = model.apply(v, x, mutable=True, rngs={"quant": jax.random.key(0)})
        return jnp.mean(jnp.square(y.astype(jnp.float32))), mutated
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def settle(fn, variables, x, steps: int = 3):
    """The variables with the scaling state that `steps` steps leave (weights unchanged): delayed scaling is then
    timed with the scales training would give it. At the initial scales (1) this loss's gradients underflow to
    zero in E5M2, and FP8 GEMMs over zeros run faster than over real data (less power, higher clocks: on an
    H100, 0.60 against 0.68 ms per gradient GEMM at d 4096), which flattered Flax FP8 and fp8_delayed."""
    if OVERWRITE not in variables and QUANT_STATE not in variables:
        return variables  # no delayed scaling: nothing to settle
    for _ in range(steps):
        (_, mutated), (grads, _) = fn(variables, x)
        variables = dict(variables)
        if OVERWRITE in variables:
            variables[OVERWRITE] = grads[OVERWRITE]
        if QUANT_STATE in variables:
            variables[QUANT_STATE] = merge_quant_state(mutated[QUANT_STATE], grads[QUANT_STATE])
    return variables


def prepare(variant: str, d: int, ff: int, tokens: int):
    """(step, variables, x) of one variant, compiled and settled."""
    x = jax.random.normal(jax.random.key(1), (tokens, d), jnp.bfloat16)
    model = Stack(ff, variant)
    fn = step_fn(model)
    variables = settle(fn, model.init({"params": jax.random.key(2), "quant": jax.random.key(3)}, x), x)
    jax.block_until_ready(fn(variables, x))  # compiled (where settling has not run it yet)
    return fn, variables, x


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="d_model x d_ff x tokens, comma-separated")
    p.add_argument("--recipes", default=RECIPES)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds over the variants of a shape (median)")
    a = p.parse_args()
    shapes = "256x512x512" if a.quick else a.shapes
    rows = []
    for shape in shapes.split(","):
        d, ff, tokens = (int(v) for v in shape.split("x"))
        variants = ["flax_bf16", "flax_fp8"] + a.recipes.split(",")
        ready = {}
        for v in variants:  # every variant compiled and settled first (XLA's FP8 autotuning takes a while)
            t0 = time.perf_counter()
            ready[v] = prepare(v, d, ff, tokens)
            print(f"  {shape} {v}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
        ms = {v: [] for v in variants}
        for _ in range(a.rounds):  # the variants in turn, round after round: drift hits all alike
            for v in variants:
                ms[v].append(1e3 * time_back_to_back(*ready[v], iters=10, reps=a.reps)[0])
        base = float(np.median(ms["flax_bf16"]))
        for v in variants:
            r = {"variant": v, "shape": shape, "ms": float(np.median(ms[v])), "ms_rounds": ms[v]}
            r["vs_flax_bf16"] = r["ms"] / base
            rows.append(r)
            print(f"  {shape} {v}: {r['ms']:.3f} ms ({r['vs_flax_bf16']:.2f}x Flax bf16)", flush=True)
        del ready
        flax_fp8 = next(r["ms"] for r in rows if r["shape"] == shape and r["variant"] == "flax_fp8")
        for r in rows:
            if r["shape"] == shape:
                r["vs_flax_fp8"] = r["ms"] / flax_fp8
        path = write_json("peer_fp8", rows, a.out)  # after every shape: a run cut short keeps what it timed
    print_table(rows, ["shape", "variant", "ms", "vs_flax_bf16", "vs_flax_fp8"])
    print("wrote", path)


if __name__ == "__main__":
    main()
