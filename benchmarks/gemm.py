"""GEMM throughput on one GPU, one process: each jaxhq FFI kernel next to XLA bf16, XLA FP8 and
jax.nn.scaled_matmul (MXFP8, NVFP4), at 8192^3 and the LLM shapes M=16384, (K, N) in {(4096, 4096),
(4096, 14336), (14336, 4096)}. TFLOP/s = 2MNK / median time; operands quantized once, outside the timing.
jaxhq_mxfp8 is the FP8-wgmma kernel on a Hopper, jaxhq_mxfp8_dq the dequantize + bf16 path; the grouped rows
split M into 8 experts (ref = the dense kernel of the same path). Each shape's rows are printed as soon as that shape finishes; the JSON is rewritten after every shape.

    python benchmarks/gemm.py [--shapes 8192x8192x8192,16384x4096x14336] [--out FILE] [--quick]

A shape is MxKxN (out[M, N] = A[M, K] @ B[N, K].T).
"""
from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
from jax import lax

from common import parser, print_table, time_back_to_back, write_json
from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, quantize
from jaxhq.ffi import gemm as G
from jaxhq.ops.gemm import fp8_gpu_dot

TN = (((1,), (1,)), ((), ()))
GROUPS = 8
SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]  # (M, K, N)


def variants(m, k, n, key):
    """{name: (jitted fn, args)}; operands built on the device."""
    ka, kb = jax.random.split(key)
    x = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kb, (n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    v = {}
    v["xla_bf16"] = (jax.jit(lambda a, b: lax.dot_general(a, b, TN)), (x, w))

    qa = quantize(x, Float8CurrentScaling("e4m3"), "rowwise").rowwise
    qb = quantize(w, Float8CurrentScaling("e4m3"), "rowwise").rowwise
    v["xla_fp8_dot_general"] = (jax.jit(lambda a, b: lax.dot_general(a, b, TN, preferred_element_type=jnp.bfloat16)),
                                (qa.data, qb.data))
    v["xla_fp8_scaled(ops.gemm)"] = (jax.jit(lambda a, b: fp8_gpu_dot(a, b, jnp.bfloat16)), (qa, qb))
    v["jaxhq_fp8_tensor"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16)), (qa, qb))
    v["jaxhq_fp8_tensor_fastacc"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16, fast_accum=True)), (qa, qb))

    ba = quantize(x, Float8Block((1, 128)), "rowwise").rowwise
    bb = quantize(w, Float8Block((128, 128)), "rowwise").rowwise
    v["jaxhq_fp8_block"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16)), (ba, bb))

    ma = quantize(x, MXFP8("e4m3"), "rowwise").rowwise
    mb = quantize(w, MXFP8("e4m3"), "rowwise").rowwise
    v["jaxhq_mxfp8"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16)), (ma, mb))  # wgmma on Hopper
    v["jaxhq_mxfp8_dq"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel="dequantize")),
                           (ma, mb))
    if m % GROUPS == 0:  # MoE: GROUPS experts of m / GROUPS rows each, same FLOPs as the dense GEMM
        wq = [quantize(jnp.roll(w, i, axis=0), MXFP8("e4m3"), "rowwise").rowwise for i in range(GROUPS)]
        sizes = jnp.full((GROUPS,), m // GROUPS, jnp.int32)
        for label, kern in (("", "auto"), ("_dq", "dequantize")):
            v[f"jaxhq_mxfp8_grouped{GROUPS}{label}"] = (
                jax.jit(lambda a, bs, gs, kern=kern: G.grouped_gemm(a, bs, gs, jnp.bfloat16, kernel=kern)),
                (ma, wq, sizes))
    v["scaled_matmul_mxfp8"] = (
        jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None],
                                                          preferred_element_type=jnp.bfloat16)[0]),
        (ma.data, mb.data, ma.scale_inv, mb.scale_inv))

    na = quantize(x, NVFP4(), "rowwise").rowwise
    nb = quantize(w, NVFP4(), "rowwise").rowwise
    v["jaxhq_nvfp4"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16)), (na, nb))
    try:  # the same E2M1 values as jnp.float4_e2m1fn, E4M3 block scales (global scale left out)
        from jaxhq.formats.casts import e2m1_decode, unpack_nibbles
        fa = e2m1_decode(unpack_nibbles(na.data)).astype(jnp.float4_e2m1fn)
        fb = e2m1_decode(unpack_nibbles(nb.data)).astype(jnp.float4_e2m1fn)
        v["scaled_matmul_nvfp4"] = (
            jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None],
                                                              preferred_element_type=jnp.bfloat16)[0]),
            (fa, fb, na.scale_inv, nb.scale_inv))
    except Exception as e:  # noqa: BLE001
        print("scaled_matmul nvfp4 operands failed:", repr(e)[:200])
    return v


REF = {"jaxhq_fp8_tensor": "xla_fp8_dot_general", "jaxhq_fp8_tensor_fastacc": "xla_fp8_dot_general",
       "jaxhq_mxfp8": "scaled_matmul_mxfp8", "jaxhq_mxfp8_dq": "scaled_matmul_mxfp8",
       f"jaxhq_mxfp8_grouped{GROUPS}": "jaxhq_mxfp8", f"jaxhq_mxfp8_grouped{GROUPS}_dq": "jaxhq_mxfp8_dq",
       "jaxhq_nvfp4": "scaled_matmul_nvfp4"}
COLUMNS = ["M", "K", "N", "kernel", "ms", "tflops", "x_bf16", "x_ref", "ref"]


def _shape(text: str) -> tuple:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not MxKxN (e.g. 8192x8192x8192)") from None
    return m, k, n


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=None, help="comma-separated MxKxN list (default: the four shapes above)")
    args = p.parse_args()
    if args.shapes:
        shapes = [_shape(t) for t in args.shapes.split(",") if t]
    else:
        shapes = [(1024, 1024, 1024)] if args.quick else SHAPES
    rows = []
    key = jax.random.PRNGKey(0)
    for (m, k, n) in shapes:
        key, sub = jax.random.split(key)
        vs = variants(m, k, n, sub)
        base = {}
        for name, (fn, a) in vs.items():
            try:
                t = time_back_to_back(fn, *a)[0]
                tf = 2.0 * m * n * k / t / 1e12
            except Exception as e:  # noqa: BLE001
                print(f"{name} {m}x{k}x{n} failed: {repr(e)[:300]}", flush=True)
                t, tf = None, None
            base[name] = tf
            rows.append({"M": m, "K": k, "N": n, "kernel": name, "ms": None if t is None else t * 1e3, "tflops": tf})
        mine = rows[-len(vs):]
        for r in mine:
            if r["tflops"]:
                r["x_bf16"] = r["tflops"] / base["xla_bf16"] if base.get("xla_bf16") else None
                ref = REF.get(r["kernel"])
                if ref and base.get(ref):
                    r["x_ref"] = r["tflops"] / base[ref]
                    r["ref"] = ref
        del vs
        gc.collect()
        print_table(mine, COLUMNS)
        print(flush=True)
        path = write_json("gemm", rows, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
