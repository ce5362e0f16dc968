"""MoE token dispatch under expert parallelism: what moves between devices and what each expert rank
multiplies, the former dispatch ("replicated": every expert gets all T*k sorted rows) against the capacity
dispatch (per-shard expert buffers sent to the experts' ranks by all-to-all), dropless and with capacity factors.

CPU only, compile only: one MoE layer's loss and gradients on N host devices (mesh data x expert), bytes read
from the compiled HLO (jaxhq.sharding.hlo; no-op collectives over single-device groups are not counted). Rows
per expert rank: the rows of the per-device expert GEMM inputs; GEMM FLOPs: those rows through fc1 and fc2,
forward and both backward GEMMs, per device. Prints a table, writes JSON (--out, default
benchmarks/results/moe_dispatch.json).
"""
from __future__ import annotations

import argparse
import os
import sys


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=int, default=2)
    p.add_argument("--expert", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (global)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--factors", default="1.0,1.25,2.0", help="capacity factors to compare")
    p.add_argument("--out", default=None)
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                               f"{ARGS.data * ARGS.expert}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jaxhq import recipes  # noqa: E402
from jaxhq.layers import MoE  # noqa: E402
from jaxhq.ops.grouped import expert_capacity  # noqa: E402
from jaxhq.sharding import axis_rules, make_mesh, mesh_axes, state_shardings  # noqa: E402
from jaxhq.sharding.hlo import collectives  # noqa: E402
from common import print_table, write_json  # noqa: E402


def compiled_hlo(model, x, mesh, rules):
    """HLO text of the layer's loss and gradients, params and tokens placed by their logical axes."""
    boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nn.unbox(boxed))

    def loss(p, x):
        return jnp.mean(model.apply({"params": p}, x, rngs={"quant": jax.random.key(1)}).astype(jnp.float32) ** 2)

    ps = state_shardings(boxed, mesh, rules)
    xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        args = (jax.device_put(params, ps), jax.device_put(x, xs))
        return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile().as_text()


def main():
    a = ARGS
    mesh, rules = make_mesh(data=a.data, expert=a.expert), axis_rules()
    shards, local = a.data * a.expert, a.experts // a.expert
    x = jax.random.normal(jax.random.key(2), (shards, a.tokens // shards, a.d_model))
    variants = [("replicated", dict(dispatch="replicated"), a.tokens * a.top_k // a.data),
                ("capacity dropless", {}, None)]
    variants += [(f"capacity cf={float(f):g}", dict(capacity_factor=float(f)), None) for f in a.factors.split(",")]
    rows = []
    for name, kw, rows_per_expert in variants:
        model = MoE(a.experts, a.top_k, a.d_ff, recipes.get(a.recipe), activation="gelu", name="moe", **kw)
        hlo = compiled_hlo(model, x, mesh, rules)
        if rows_per_expert is None:  # expert e's buffer: the expert ranks' shards of one data replica
            rows_per_expert = a.expert * expert_capacity(a.tokens // shards, a.experts, a.top_k,
                                                         kw.get("capacity_factor"))
        moved = {k: sum(c.nbytes for c in collectives(hlo, k)) for k in ("all-to-all", "all-gather", "all-reduce")}
        r = local * rows_per_expert
        rows.append({"variant": name, "all_to_all_MB": moved["all-to-all"] / 2 ** 20,
                     "all_gather_MB": moved["all-gather"] / 2 ** 20, "all_reduce_MB": moved["all-reduce"] / 2 ** 20,
                     "rows_per_expert_rank": r, "expert_gemm_GFLOP": 3 * 2 * r * 2 * a.d_model * a.d_ff / 1e9})
    cols = ["variant", "all_to_all_MB", "all_gather_MB", "all_reduce_MB", "rows_per_expert_rank", "expert_gemm_GFLOP"]
    print(f"{a.tokens} tokens, top-{a.top_k} of {a.experts} experts, d={a.d_model}, d_ff={a.d_ff}, {a.recipe}, "
          f"mesh data={a.data} x expert={a.expert} (per device)")
    print_table(rows, cols)
    out = write_json("moe_dispatch", rows, a.out, mesh=dict(data=a.data, expert=a.expert), experts=a.experts,
                     top_k=a.top_k, tokens=a.tokens, d_model=a.d_model, d_ff=a.d_ff, recipe=a.recipe)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
