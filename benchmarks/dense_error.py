"""Relative error of forward, dgrad and wgrad of the dense op under each named recipe, against the bf16 op."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxhq
from common import parser, print_table, write_json
from jaxhq import recipes
from jaxhq.formats import init_state

NAMED = ["fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"]


def run(name, x, w, dy):
    qs = recipes.get(name).dense_quantizers("bench")
    # Delayed scaling starts from a state whose scale was set by one earlier step on the same data.
    states = {}
    for s in ("input", "weight", "grad_output"):
        q = getattr(qs, s)
        if q.stateful:
            amax = jnp.max(jnp.abs({"input": x, "weight": w, "grad_output": dy}[s])).astype(jnp.float32)
            st = init_state(q)
            states[s] = q.update_state(st, amax)
    f = jax.jit(lambda x, w: jax.vjp(lambda a, b: jaxhq.dense(a, b, quantizers=qs, states=states,
                                                                 key=jax.random.PRNGKey(0)), x, w))
    y, vjp = f(x, w)
    dx, dw = jax.jit(vjp)(dy)
    return y, dx, dw


def main():
    args = parser(__doc__).parse_args()
    n = 512 if args.quick else 4096
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w, dy = (jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in ks)
    ref = [np.asarray(a, np.float64) for a in run("bf16", x, w, dy)]
    rows = []
    for name in NAMED:
        out = [np.asarray(a, np.float64) for a in run(name, x, w, dy)]
        r = {"recipe": name, "shape": f"{n}^3"}
        for label, a, b in zip(("forward", "dgrad", "wgrad"), out, ref):
            r[label] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        rows.append(r)
        print(r, flush=True)
    print_table(rows, ["recipe", "shape", "forward", "dgrad", "wgrad"])
    print("wrote", write_json("dense_error", rows, args.out))


if __name__ == "__main__":
    main()
