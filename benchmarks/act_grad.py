"""The MLP activation's input gradient quantized from h and dy in one launch, against XLA computing the gradient
and the quantize kernel reading it (JAXHQ_QUANTIZE_PATH act_grad=xla), in one process: the measurement behind
formats.quantize.ACT_GRAD_MIN_ELEMENTS, the size from which the FP8 families take the launch.

Shape: fc1's output of the H100 training preset (8192 tokens, gated 2 x 14336; --quick: 1024 x 2 x 1024), or the
--shapes given (TOKENSxF, comma-separated; the quick preset's fc1 is 4096x3584). Per
format (both copies, as fc1's backward makes them): the fused launch, the unfused pair, and XLA's gradient alone;
the bytes the fused launch must move (h, dy, the copies) as a fraction of the device copy's bandwidth. Prints a
table; writes JSON (--out).
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from common import environ, parser, print_table, time_back_to_back, write_json  # noqa: E402

from jaxhq.ffi import available  # noqa: E402
from jaxhq.formats import MXFP8, Float8Block, Float8DelayedScaling, init_state, quantize  # noqa: E402
from jaxhq.ops import activation as A  # noqa: E402

FORMATS = {"mxfp8_dec": (MXFP8(), ("rowwise", "columnwise")), "fp8_block_1x128": (Float8Block(), ()),
           "fp8_delayed_e5m2": (Float8DelayedScaling(fmt="e5m2"), ())}


def nbytes(tree):
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--activations", default="swiglu,gelu")
    p.add_argument("--shapes", default=None, help="TOKENSxF, comma-separated (default 8192x14336; --quick 1024x1024)")
    args = p.parse_args()
    shapes = args.shapes or ("1024x1024" if args.quick else "8192x14336")
    dev = jax.devices()[0]
    print("device:", dev.device_kind, "jax", jax.__version__, "kernels on gpu:", available("gpu"), flush=True)
    bench = lambda fn, *a: time_back_to_back(fn, *a, iters=20, reps=5)[0]  # noqa: E731

    rows = []
    for shape, activation in ((s, a) for s in shapes.split(",") for a in args.activations.split(",")):
        tokens, f = (int(v) for v in shape.split("x"))
        width = 2 * f if A.is_gated(activation) else f
        kh, kd = jax.random.split(jax.random.key(0))
        h = jax.device_put(jax.random.normal(kh, (tokens, width), jnp.float32).astype(jnp.bfloat16), dev)
        dy = jax.device_put(jax.random.normal(kd, (tokens, f), jnp.float32).astype(jnp.bfloat16), dev)
        copy_t = bench(jax.jit(lambda t: -t), h)
        copy_bw = 2 * h.size * 2 / copy_t
        grad = jax.jit(lambda h, dy: A.input_grad(h, dy, activation).grad())
        t_grad = bench(grad, h, dy)
        for name, (q, dec) in FORMATS.items():
            st = init_state(q)
            fused = jax.jit(lambda h, dy, st, q=q, dec=dec: quantize(A.input_grad(h, dy, activation), q, state=st,
                                                                     decoded=dec))
            unfused = jax.jit(lambda h, dy, st, q=q, dec=dec: quantize(A.input_grad(h, dy, activation).grad(), q,
                                                                       state=st, decoded=dec))
            with environ({"JAXHQ_QUANTIZE_PATH": "act_grad=kernel"}):  # the launch at any size and format, traced
                moved = nbytes((h, dy)) + nbytes(fused(h, dy, st))
            t_f, t_u = bench(fused, h, dy, st), bench(unfused, h, dy, st)
            row = dict(activation=activation, format=name, shape=f"{tokens}x{width}", fused_ms=t_f * 1e3,
                       unfused_ms=t_u * 1e3, xla_grad_ms=t_grad * 1e3, speedup=t_u / t_f,
                       fused_frac_copy=moved / t_f / copy_bw, copy_tbps=copy_bw / 1e12)
            rows.append(row)
            print(f"  {shape} {activation} {name}: fused {t_f * 1e3:.3f} ms, unfused {t_u * 1e3:.3f} ms "
                  f"({t_u / t_f:.2f}x), {100 * row['fused_frac_copy']:.0f}% of copy", flush=True)
    print_table(rows, ["activation", "format", "shape", "fused_ms", "unfused_ms", "speedup", "xla_grad_ms",
                       "fused_frac_copy"])
    print("wrote", write_json("act_grad", rows, args.out))


if __name__ == "__main__":
    main()
