"""One MoE layer's forward + backward (loss and gradients of its parameters and input), per recipe and token
dispatch, against bf16 with the default dispatch in the same run.

Dispatches: "capacity" (per-expert buffers; dropless: every expert's buffer holds all the tokens, so every expert
multiplies all of them), "capacity" with a capacity factor (buffers of factor * top_k * tokens / experts rows,
overflow dropped), and "grouped" (the sorted token copies through one ragged grouped GEMM per forward and dgrad
GEMM, the wgrad one GEMM grouped along the tokens; a recipe it does not take gets the op's refusal as its row's
error). Each row: median ms of back-to-back
jitted steps, its ratio to bf16's first row (dropless capacity unless --dispatches leaves it out), the expert GEMMs'
useful TFLOP/s (6 x routed tokens x d x d_ff x 3: swiglu's fc1 has 2 d_ff outputs, fc2 d_ff inputs; only the rows
that are routed count), and the compile time. --paths runs each quantized recipe under switches read at trace time
as well (A/B in one process). Prints each row as it finishes; JSON to --out.

    python benchmarks/moe_step.py                  # on a GPU: 8 experts, top-2, 8192 tokens, d 2048, d_ff 4096
    python benchmarks/moe_step.py --quick          # a small layer (the CPU default)
    python benchmarks/moe_step.py --recipes bf16,mxfp8 --dispatches grouped --paths 'default;env:JAXHQ_DQ_GROUPED=host'
"""
from __future__ import annotations

import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environ, parser, path_env, print_table, time_back_to_back, write_json  # noqa: E402

from jaxhq import recipes  # noqa: E402
from jaxhq.layers import MoE  # noqa: E402

COLUMNS = ["recipe", "dispatch", "path", "ms", "vs_bf16", "tflops", "compile_s", "error"]
DISPATCHES = ("capacity", "factor", "grouped")  # dropless capacity, capacity with --factor, grouped


def case(recipe: str, dispatch: str, factor, x, experts: int, top_k: int, d_ff: int):
    """(ms, compile seconds) of one jitted loss-and-gradients step of the layer."""
    model = MoE(experts, top_k, d_ff, recipes.get(recipe), activation="swiglu", dispatch=dispatch,
                capacity_factor=factor, dtype=jnp.bfloat16, name="moe")
    params = nn.unbox(model.init(jax.random.key(1), x)["params"])

    def loss(p, x):
        out = model.apply({"params": p}, x, rngs={"quant": jax.random.key(2)})
        return jnp.sum(out.astype(jnp.float32) ** 2)

    t0 = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(params, x).compile()
    compile_s = time.perf_counter() - t0
    return 1e3 * time_back_to_back(step, params, x)[0], compile_s


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,fp8_block,mxfp8")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=None, help="default: 8192 on a GPU, 512 elsewhere or --quick")
    p.add_argument("--d-model", type=int, default=None, help="default: 2048 on a GPU, 128 elsewhere or --quick")
    p.add_argument("--d-ff", type=int, default=None, help="default: 4096 on a GPU, 256 elsewhere or --quick")
    p.add_argument("--factor", type=float, default=1.25, help="the capacity factor of the dropping dispatch")
    p.add_argument("--dispatches", default=",".join(DISPATCHES), help=f"a subset of {','.join(DISPATCHES)}")
    p.add_argument("--paths", default="default",
                   help="';'-separated: 'default' and env:NAME=VALUE switches read at trace time, each quantized "
                        "recipe run under each (e.g. 'default;env:JAXHQ_DQ_GROUPED=host')")
    a = p.parse_args()
    unknown = set(a.dispatches.split(",")) - set(DISPATCHES)
    if unknown:
        raise SystemExit(f"--dispatches: unknown {sorted(unknown)}; known: {', '.join(DISPATCHES)}")
    paths = [(q, path_env(q)) for q in a.paths.split(";")]
    small = a.quick or jax.default_backend() == "cpu"
    tokens = a.tokens or (512 if small else 8192)
    d, d_ff = a.d_model or (128 if small else 2048), a.d_ff or (256 if small else 4096)
    x = jax.random.normal(jax.random.key(0), (1, tokens, d), jnp.float32).astype(jnp.bfloat16)
    flops = 6.0 * tokens * a.top_k * d * d_ff * 3  # swiglu: fc1 has 2 d_ff outputs, fc2 d_ff inputs
    print(f"MoE: {a.experts} experts, top-{a.top_k}, {tokens} tokens, d {d}, d_ff {d_ff} (swiglu); "
          f"{jax.devices()[0].device_kind}", flush=True)
    rows, base = [], None
    by_name = {"capacity": ("capacity", None), "factor": ("capacity", a.factor), "grouped": ("grouped", None)}
    cases = [by_name[name] for name in DISPATCHES if name in a.dispatches.split(",")]
    for recipe in a.recipes.split(","):
        for (dispatch, factor), (path, env) in ((c, q) for c in cases for q in (paths[:1] if recipe == "bf16"
                                                                                 else paths)):
            label = dispatch if factor is None else f"{dispatch} x{factor:g}"
            row = dict(recipe=recipe, dispatch=label, path=path)
            try:
                with environ(env):
                    ms, compile_s = case(recipe, dispatch, factor, x, a.experts, a.top_k, d_ff)
                base = ms if base is None and recipe == "bf16" else base
                row |= dict(ms=ms, vs_bf16=None if base is None else ms / base, tflops=flops / ms / 1e9,
                            compile_s=compile_s)
            except Exception as e:  # a dispatch a recipe cannot take: say so and go on
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(f"  {recipe} {label} [{path}]: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in row.items()
                                                       if k not in ("recipe", "dispatch", "path")),
                  flush=True)
    print_table(rows, COLUMNS)
    print("wrote", write_json("moe_step", rows, a.out, experts=a.experts, top_k=a.top_k, tokens=tokens, d_model=d,
                              d_ff=d_ff))


if __name__ == "__main__":
    main()
