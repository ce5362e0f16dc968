"""Quantize kernels vs a device copy vs the jnp reference compiled by XLA, all in one process.

For a 16384x16384 bf16 input and each format (both copies) and a few hybrid pairs: the median time, the
effective bandwidth (input bytes once, twice for formats that need the per-tensor amax first, plus every
output byte), its fraction of the copy bandwidth, and the speedup over XLA. Hybrid pairs are also timed as
two separate single-copy kernel passes. Cases ending in `_dec` write both copies decoded (their bf16 values,
as the training step does on Hopper for the copies a GEMM reads at once; docs/gemm.md). The copies are timed as
the GEMMs take them: 1x128 and MXFP8 scales in the quantize launch's rows-inner layout (common.as_launched), so
no transpose of XLA's is timed with the launch. Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

from common import as_launched, time_back_to_back
from jaxhq.ffi import available
from jaxhq.ffi.dispatch import quantize_copies
from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Hybrid
from jaxhq.formats.base import USAGES
from jaxhq.formats.hybrid import side


bench = functools.partial(time_back_to_back, iters=20, reps=7)


def launched(copies):
    """The copies as the GEMMs take them (common.as_launched), so the timed program is the launch alone."""
    return {a: as_launched(s) for a, s in copies.items()}


def nbytes(tree):
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def reference(x, q, usage):
    out = {}
    for a in usage:
        arr = x if a == "rowwise" else x.T
        sk = jax.random.fold_in(jax.random.key(0), USAGES.index(a))
        out[a] = side(q, a).quantize_2d(arr, a, key=sk)
    return out


def needs_amax(q, usage):
    return any(isinstance(side(q, a), (Float8CurrentScaling, NVFP4)) for a in usage)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=16384)
    p.add_argument("--out", default="quantize_bench.json")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = p.parse_args()
    dev = jax.devices()[0]
    print("device:", dev.device_kind, "jax", jax.__version__, "kernels on gpu:", available("gpu"), flush=True)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (args.m, args.k), jnp.float32).astype(jnp.bfloat16), dev)
    xbytes = x.size * 2

    copy_t, _ = bench(jax.jit(lambda x: jnp.copy(x) + jnp.bfloat16(0)), x)  # a read + write of every byte
    neg_t, _ = bench(jax.jit(lambda x: -x), x)
    copy_bw = 2 * xbytes / min(copy_t, neg_t)
    print(f"device copy: {min(copy_t, neg_t) * 1e3:.3f} ms, {copy_bw / 1e12:.2f} TB/s (read+write)", flush=True)

    key = jax.random.key(1)
    cases = [
        ("fp8_current", Float8CurrentScaling()),
        ("mxfp8", MXFP8()),
        ("nvfp4", NVFP4()),
        ("nvfp4_2d", NVFP4(block_2d=True)),
        ("nvfp4_rht", NVFP4(rht=True)),
        ("nvfp4_sr", NVFP4(stochastic_rounding=True)),
        ("nvfp4_rht_sr", NVFP4(rht=True, stochastic_rounding=True)),  # the nvfp4 recipe's gradients
        ("mxfp8_dec", MXFP8()),
        ("nvfp4_dec", NVFP4()),
        ("nvfp4_rht_dec", NVFP4(rht=True)),  # the nvfp4 recipe's inputs as the step writes them
        ("nvfp4_rht_sr_dec", NVFP4(rht=True, stochastic_rounding=True)),  # the gradients as the step writes them
        ("fp8_block_1x128", Float8Block()),
        ("fp8_block_128x128", Float8Block((128, 128))),
        ("fp8_block_1x128_colonly", Float8Block()),
        ("hyb mxfp8|nvfp4_rht", Hybrid(MXFP8(), NVFP4(rht=True))),
        ("hyb mxfp8|nvfp4_rht_dec", Hybrid(MXFP8(), NVFP4(rht=True))),  # the hybrid recipe's inputs, both decoded
        ("hyb fp8_block_1x128|mxfp8", Hybrid(Float8Block(), MXFP8())),
        ("hyb nvfp4_2d|fp8_block_128x128", Hybrid(NVFP4(block_2d=True), Float8Block((128, 128)))),
        ("hyb fp8_current|nvfp4", Hybrid(Float8CurrentScaling(), NVFP4())),
    ]
    if args.cases:
        names = args.cases.split(",")
        unknown = sorted(set(names) - {n for n, _ in cases})
        if unknown:
            p.error(f"unknown cases {unknown}; known: {', '.join(n for n, _ in cases)}")
        cases = [c for c in cases if c[0] in names]
    rows = []
    for name, q in cases:
        usage = ("columnwise",) if name.endswith("colonly") else USAGES
        decoded = usage if name.endswith("_dec") else ()

        def copies(x, k, q=q, usage=usage, decoded=decoded):
            return launched(quantize_copies(x, q, usage, key=k, decoded=decoded))

        kern = jax.jit(copies)
        out = kern(x, key)
        assert out is not None, name
        obytes = nbytes(out)
        moved = xbytes * (2 if needs_amax(q, usage) else 1) + obytes
        t, ts = bench(kern, x, key)
        row = dict(name=name, format=q.label, usage=list(usage), decoded=list(decoded), ms=t * 1e3,
                   ms_all=[v * 1e3 for v in ts], bytes=moved, tbps=moved / t / 1e12, frac_copy=moved / t / copy_bw)
        if not args.no_xla:
            ref = jax.jit(lambda x, q=q, usage=usage: reference(x, q, usage))
            try:
                tx, _ = bench(ref, x, iters=5, reps=3)
                row.update(xla_ms=tx * 1e3, speedup_vs_xla=tx / t)
            except Exception as e:  # noqa: BLE001
                row.update(xla_error=str(e)[:200])
        if isinstance(q, Hybrid):
            def one(q, a, decoded=decoded):  # one side's pass, decoded as in the one-pass case
                return jax.jit(lambda x, k: launched(quantize_copies(x, q, (a,), key=k,
                                                                     decoded=tuple(d for d in decoded if d == a))))
            r1, r2 = one(q.rowwise, "rowwise"), one(q.columnwise, "columnwise")
            two = jax.jit(lambda x, k: (r1(x, k), r2(x, k)))
            t2, _ = bench(two, x, key)
            row.update(two_pass_ms=t2 * 1e3, fused_speedup=t2 / t)
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "ms_all"}),
              flush=True)
        del out

    res = dict(device=dev.device_kind, jax=jax.__version__, shape=[args.m, args.k], dtype="bfloat16",
               variant=os.environ.get("JAXHQ_QUANTIZE_VARIANT", "registers"),
               copy_ms=min(copy_t, neg_t) * 1e3, copy_tbps=copy_bw / 1e12, rows=rows)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{args.m}x{args.k} bf16 on {dev.device_kind}; copy {copy_bw / 1e12:.2f} TB/s; "
          f"quantize kernel variant {res['variant']}")
    print(f"{'case':34s} {'ms':>7s} {'TB/s':>6s} {'%copy':>6s} {'XLA ms':>8s} {'vsXLA':>6s} {'2pass ms':>9s} {'fused x':>7s}")
    for r in rows:
        print(f"{r['name']:34s} {r['ms']:7.3f} {r['tbps']:6.2f} {100 * r['frac_copy']:5.1f}% "
              f"{r.get('xla_ms', float('nan')):8.3f} {r.get('speedup_vs_xla', float('nan')):6.2f} "
              f"{r.get('two_pass_ms', float('nan')):9.3f} {r.get('fused_speedup', float('nan')):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
