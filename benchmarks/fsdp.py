"""Sharded training steps: bytes gathered and reduced per step (from the compiled HLO), and on GPUs the step
time, bf16 and XLA versus each recipe, under FSDP, tensor parallelism (tp) and sequence parallelism (sp).

The model is a stack of pre-norm MLP blocks (rmsnorm, up [d, ff], gelu, down [ff, d]) with fp32 master weights
sharded on `fsdp` (layout fsdp) or split column/row-parallel on `tensor` (tp, sp), computed in bf16. Every variant goes through jaxhq.ops.dense with the same FSDP hook
(jaxhq.sharding.weight_sharding): each weight is gathered for the forward and again for the backward, as FSDP
does; the bf16 recipe gathers bf16, the others their quantized copies (data and block scales as uint8).
A "+keep" suffix (e.g. "fp8_current+keep") builds the step with reshard_after_forward=False: the columnwise
copies are gathered in the forward and kept for the backward. As many bytes move per step; the trade shows with
the step compiled as forward and backward programs: bytes the forward hands over (fwd_to_bwd_bytes, per device)
against the backward's weight gathers (bwd_weight_gather_bytes). temp_bytes, arg_bytes: the one-program step's.
"xla_bf16" is plain `x @ w` in bf16 with XLA choosing the gathers (it keeps the gathered weight for the
backward). Targets: gathered bytes <= 0.55x bf16 for FP8/MXFP8 and <= 0.3x for NVFP4.

CPU (default): compiles only, on N host devices (--devices, default 8), and reads the bytes from the HLO.
--gpu: all local GPUs on one axis per layout; also times the step (median of --iters after warm-up).
other_gather_bytes: all-gathers that are not weight copies (activations; target 0 outside sp; under sp the
quantized copies of the length-split activations). all_reduce_bytes, reduce_scatter_bytes: what the reductions
of arrays produce per device (tp all-reduces the row-parallel outputs, sp reduce-scatters them).
Prints a table and writes JSON (--out, default benchmarks/results/fsdp[_gpu].json).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

RECIPES = ["bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "fp8_block", "hybrid:mxfp8:nvfp4"]
TARGETS = {"fp8_current": 0.55, "fp8_delayed": 0.55, "mxfp8": 0.55, "fp8_block": 0.55, "nvfp4": 0.3,
           "hybrid:mxfp8:nvfp4": 0.55}


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="run on the local GPUs and time the step")
    p.add_argument("--devices", type=int, default=8, help="CPU host devices (CPU mode)")
    p.add_argument("--time", action="store_true", help="also time the step (implied by --gpu)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--d-ff", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--recipes", default=",".join(["xla_bf16"] + RECIPES),
                   help="comma-separated variants: xla_bf16, a recipe, or RECIPE+keep (reshard_after_forward=False)")
    p.add_argument("--layouts", default=None,
                   help="comma-separated, of fsdp (weights sharded, gathered as quantized bytes), tp (Megatron "
                        "column/row-parallel on the tensor axis), sp (tp plus the sequence split on it); all "
                        "devices on one axis. Default: fsdp on the CPU, fsdp,tp,sp with --gpu")
    p.add_argument("--out", default=None)
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and not ARGS.gpu:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxhq  # noqa: E402
from jaxhq import recipes  # noqa: E402
from jaxhq.formats import Float8DelayedScaling, init_state  # noqa: E402
from jaxhq.sharding import axis_rules, constrain, make_mesh, mesh_axes, weight_sharding  # noqa: E402
from jaxhq.sharding.hlo import by_dtype, collectives  # noqa: E402
from common import print_table, time_fn, write_json  # noqa: E402

AXES = {"up": ("embed", "mlp"), "down": ("mlp", "embed"), "scale": ("embed",)}


def init(layers, d, ff, batch, seq, seed=0):
    ks = iter(jax.random.split(jax.random.key(seed), 3 * layers + 1))
    params = [{"scale": jnp.ones((d,)), "up": jax.random.normal(next(ks), (d, ff)) * d ** -0.5,
               "down": jax.random.normal(next(ks), (ff, d)) * ff ** -0.5} for _ in range(layers)]
    x = jax.random.normal(next(ks), (batch, seq, d), jnp.bfloat16)
    return params, x


def _delayed_states(recipe, layers):
    """Delayed-scaling states per dense (only for stateful recipes), carried as step inputs."""
    q = recipe.dense_quantizers("x")
    if not isinstance(q.input, Float8DelayedScaling):
        return None
    return [{n: {s: init_state(getattr(q, s)) for s in ("input", "weight", "grad_output")} for n in ("up", "down")}
            for _ in range(layers)]


LAYOUTS = {"fsdp": ("fsdp", False), "tp": ("tensor", False), "sp": ("tensor", True)}  # mesh axis, seq. parallel


def variant(name):
    """(recipe name, reshard_after_forward) of a variant name: RECIPE or RECIPE+keep."""
    base, plus, option = name.partition("+")
    if plus and (option != "keep" or base == "xla_bf16"):
        raise SystemExit(f"unknown variant {name!r}: a recipe name, optionally with '+keep' (not xla_bf16)")
    return base, not plus


def make_loss(name, mesh):
    """(params, x, states) -> loss: the training step's forward under variant `name`."""
    base, reshard_after_forward = variant(name)
    hook = base != "xla_bf16"
    recipe = recipes.get("bf16" if base == "xla_bf16" else base)

    def loss_fn(params, x, states):
        h = constrain(x, ("batch", "length", "embed"), mesh)
        for i, p in enumerate(params):
            n = h.astype(jnp.float32)
            n = (n * jax.lax.rsqrt(jnp.mean(n * n, -1, keepdims=True) + 1e-6) * p["scale"]).astype(jnp.bfloat16)
            for part in ("up", "down"):
                k = p[part].astype(jnp.bfloat16)  # per shard: the cast runs before any gather
                if not hook:
                    n = n @ k
                else:
                    qs = recipe.dense_quantizers(f"layers_{i}.{part}")
                    ws = weight_sharding(AXES[part], f"layers_{i}.{part}", mesh=mesh,
                                         reshard_after_forward=reshard_after_forward)
                    st = None if states is None else states[i][part]
                    n = jaxhq.dense(n, k, quantizers=qs, weight_sharding=ws, states=st,
                                    key=jax.random.key(i * 2 + (part == "down")))
                if part == "up":
                    n = jax.nn.gelu(constrain(n, ("batch", "length", "mlp"), mesh))
            h = h + constrain(n, ("batch", "length", "embed"), mesh)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return loss_fn, recipe


def _weight_gathers(gathers, params):
    """Weight gathers, told apart by element count: a kernel copy holds d * ff elements over a power of two
    (packed FP4, block scales), in whatever 2D shape the backend gathers it (XLA's GPU backend gathers along
    the major dim, then transposes). d and ff are powers of two and the token counts are not (seq 96 / 1536),
    so activation gathers are counted apart, as are the norm scales (1D fp32)."""
    d, ff = params[0]["up"].shape
    return [c for c in gathers if len(c.shape) == 2 and (d * ff) % math.prod(c.shape) == 0
            and _power_of_two(d * ff // math.prod(c.shape))]


def _dtypes(cols) -> str:
    return ",".join(f"{d}:{b}" for d, b in sorted(by_dtype(cols).items()))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _split(loss_fn, args, params):
    """(bytes per device the forward hands to the backward, the backward's weight gathers) of the step compiled
    as two programs, forward (jax.vjp) then backward. In one program XLA places each gather where it likes, so
    reshard_after_forward binds only where something fixes what is saved (separate programs, scanned layers)."""
    fwd = jax.jit(lambda ps, x, st: jax.vjp(lambda ps: loss_fn(ps, x, st), ps)).lower(*args).compile()
    _, vjp_fn = fwd(*args)
    bwd = jax.jit(lambda f, g: f(g)).lower(vjp_fn, jnp.float32(1)).compile()
    held = getattr(fwd.memory_analysis(), "output_size_in_bytes", None)
    return held, _weight_gathers(collectives(bwd.as_text(), "all-gather"), params)


def run(name, layout, params, x, timed):
    axis, sp = LAYOUTS[layout]
    mesh, rules = make_mesh(**{axis: len(jax.devices())}), axis_rules(sequence_parallel=sp)
    with nn.logical_axis_rules(rules):  # constrain and weight_sharding read the rules from the context
        loss_fn, recipe = make_loss(name, mesh)
        step = jax.value_and_grad(loss_fn)
        states = None if variant(name)[0] == "xla_bf16" else _delayed_states(recipe, len(params))
        ps = [{k: NamedSharding(mesh, mesh_axes(AXES[k], rules, mesh)) for k in p} for p in params]
        xs = NamedSharding(mesh, mesh_axes(("batch", "length", "embed"), rules, mesh))
        jitted = jax.jit(step, in_shardings=(ps, xs, None), out_shardings=(None, ps))
        args = (jax.device_put(params, ps), jax.device_put(x, xs), states)
        compiled = jitted.lower(*args).compile()
        hlo = compiled.as_text()
        split = _split(loss_fn, args, params) if layout == "fsdp" else (None, [])
    gathers = collectives(hlo, "all-gather")
    weight_elems = sum(int(p[k].size) for p in params for k in ("up", "down"))
    wg = _weight_gathers(gathers, params)
    other = [c for c in gathers if c not in wg]
    row = {"layout": layout, "variant": name, "weight_gather_bytes": sum(c.nbytes for c in wg),
           "bytes_per_weight_elem": sum(c.nbytes for c in wg) / weight_elems,
           "gathers": len(wg), "weight_dtypes": _dtypes(wg),
           "other_gather_bytes": sum(c.nbytes for c in other), "other_gather_dtypes": _dtypes(other)}
    for kind in ("all-reduce", "reduce-scatter"):  # of arrays (not scalar amaxes), per device, by what they produce
        row[kind.replace("-", "_") + "_bytes"] = sum(c.nbytes for c in collectives(hlo, kind) if len(c.shape) > 1)
    mem = compiled.memory_analysis()  # per device; None (or missing fields) on backends that do not report it
    row["temp_bytes"] = getattr(mem, "temp_size_in_bytes", None)
    row["arg_bytes"] = getattr(mem, "argument_size_in_bytes", None)
    row["fwd_to_bwd_bytes"] = split[0]  # the FSDP layout only: where reshard_after_forward binds
    row["bwd_weight_gather_bytes"] = sum(c.nbytes for c in split[1])
    if timed:
        row["step_ms"] = 1e3 * time_fn(compiled, *args, iters=ARGS.iters)
    return row


def main():
    a = ARGS
    n = len(jax.devices())
    gpu = a.gpu
    if gpu and jax.default_backend() != "gpu":
        raise SystemExit(f"--gpu: no GPU backend (backend {jax.default_backend()})")
    d = a.d_model or (4096 if gpu else 1024)
    ff = a.d_ff or (4 * d)
    batch = a.batch or (8 if gpu else 16)
    seq = a.seq or (1536 if gpu else 96)
    if not _power_of_two(d * ff) or _power_of_two(batch * seq):
        raise SystemExit("weight gathers are told from activation gathers by element count: d_model * d_ff must "
                         f"be a power of two and batch * seq must not (got {d} * {ff}, {batch} * {seq})")
    params, x = init(a.layers, d, ff, batch, seq)
    rows = []
    for layout in (a.layouts or ("fsdp,tp,sp" if gpu else "fsdp")).split(","):
        for name in a.recipes.split(","):
            rows.append(run(name, layout, params, x, timed=gpu or a.time))
            r = rows[-1]
            print(f"  {layout} {name}: other gathers {r['other_gather_bytes']} B"
                  + (f", step {r['step_ms']:.2f} ms" if "step_ms" in r else ""), flush=True)
    for r in rows:
        same = {o["variant"]: o for o in rows if o["layout"] == r["layout"]}
        base, xla = same.get("bf16"), same.get("xla_bf16")
        if base and base["weight_gather_bytes"]:
            r["ratio_vs_bf16"] = r["weight_gather_bytes"] / base["weight_gather_bytes"]
        if base and "step_ms" in r:
            r["speedup_vs_bf16"] = base["step_ms"] / r["step_ms"]
        if xla and "step_ms" in r:
            r["time_vs_xla_bf16"] = r["step_ms"] / xla["step_ms"]
        t = TARGETS.get(variant(r["variant"])[0]) if r["layout"] == "fsdp" else None
        r["target"] = t
        r["meets_target"] = None if t is None or "ratio_vs_bf16" not in r else bool(r["ratio_vs_bf16"] <= t)
    cols = ["layout", "variant", "weight_gather_bytes", "bytes_per_weight_elem", "ratio_vs_bf16", "target",
            "meets_target", "gathers", "weight_dtypes", "other_gather_bytes", "other_gather_dtypes", "all_reduce_bytes",
            "reduce_scatter_bytes", "temp_bytes",
            "fwd_to_bwd_bytes", "bwd_weight_gather_bytes"]
    cols += ["step_ms", "speedup_vs_bf16", "time_vs_xla_bf16"] if gpu or a.time else []
    print(f"\nSharded over {n} {jax.default_backend()} devices: {a.layers} blocks, d={d}, ff={ff}, "
          f"tokens/step={batch * seq}")
    print_table(rows, cols)
    out = write_json("fsdp_gpu" if gpu else "fsdp", rows, a.out, devices=n, layers=a.layers, d_model=d, d_ff=ff,
                     batch=batch, seq=seq)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
