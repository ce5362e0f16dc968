"""GEMM throughput on one GPU, one process: each jaxhq FFI kernel next to XLA bf16, XLA FP8 and
jax.nn.scaled_matmul (MXFP8, NVFP4), at 8192^3 and the LLM shapes M=16384, (K, N) in {(4096, 4096),
(4096, 14336), (14336, 4096)}. TFLOP/s = 2MNK / median time; operands quantized once, outside the timing.
jaxhq_mxfp8 is the FP8-wgmma kernel on a Hopper, jaxhq_mxfp8_dq the dequantize + bf16 path; jaxhq_nvfp4 is the
dequantize + bf16 path, jaxhq_nvfp4_wgmma (Hopper) the codes decoded on chip into fp16 wgmma; the grouped rows
split M into 8 experts, their weights stacked once outside the timing (ref = the dense kernel of the same
path; xla_bf16_ragged_dot: XLA's bf16 `lax.ragged_dot`, jaxhq_bf16_grouped: jaxhq's (CUTLASS), ref = XLA
bf16; FP8 grouped: the default kernel with the group sizes read on the device, CUTLASS's where built; `_wgmma`
the hand-written one, `_unpaired` that one without its two-CTA clusters (JAXHQ_WGMMA_CLUSTER=1), `_lt` cuBLASLt
per group with the sizes read on the host (MXFP8's and NVFP4's `_dq_host`: the dequantize path's cuBLASLt loop,
where `_dq` is CUTLASS's bf16 grouped kernel with the sizes on the device); ref = the dense cuBLASLt kernel;
`_fastacc` the per-tensor default with fast accumulation, ref = the dense cuBLASLt kernel with it). Every variant
of a shape is compiled first, then all are timed in turn for --rounds rounds (median per variant), so clock drift
during the run does not favour the first rows. jaxhq_fp8_block is 1x128 x 128x128 (forward, dgrad),
jaxhq_fp8_block_1d1d 1x128 x 1x128 (wgrad), its `_segment8` row the MoE wgrad (K cut into 8 segments, one [M, N]
output each: `segment_gemm`, CUTLASS) and `_segment1` the same dense GEMM on that CUTLASS kernel (one segment);
`_cutlass1` rows: the dense FP8 GEMM on CUTLASS's grouped kernel with one group (ref = cuBLASLt's). 1x128 and
MXFP8 operands come with their scales as the quantize launch writes them, as in a training step (`_as_in_a_step`).
`_decoded` rows take the operands as a training step hands them to these GEMMs on a Hopper: decoded copies (the
quantize launch's bf16 values, no dequantize pass in the GEMM); the grouped one against the dense one.
Each shape's rows are printed as soon as that shape finishes; the JSON is rewritten after every shape.
--chain N times N calls of each variant in one jitted program, each on its own copy of the operands (no call is
merged with another), and reports the time per call: at small shapes (a d 1024 model's GEMMs, tens of us) a
standalone call's host dispatch outlasts the GEMM, while in a training step XLA launches them from its graphs.

    python benchmarks/gemm.py [--shapes 8192x8192x8192,16384x4096x14336] [--chain 8] [--out FILE] [--quick]
                              [--kernels grouped8,_decoded]

A shape is MxKxN (out[M, N] = A[M, K] @ B[N, K].T).
"""
from __future__ import annotations

import functools
import gc
import time

import jax
import jax.numpy as jnp
from jax import lax

from common import as_launched, environ, parser, print_table, time_back_to_back, write_json
from jaxhq.formats import MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Identity, Storage, quantize
from jaxhq.ffi import gemm as G
from jaxhq.ffi import primitives as P
from jaxhq.ops.gemm import fp8_gpu_dot

TN = (((1,), (1,)), ((), ()))
GROUPS = 8
SHAPES = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]  # (M, K, N)


@functools.lru_cache(maxsize=None)
def _quantizer(fmt):
    """One jitted program per format: x -> its rowwise copy in fmt."""
    return jax.jit(lambda t: quantize(t, fmt, "rowwise").rowwise)


@functools.lru_cache(maxsize=None)
def _decoded(fmt):
    """x -> its rowwise copy in fmt written decoded (bf16 values), as the quantize launch writes the copies a
    training step's GEMM reads at once on a Hopper (ops.gemm.decoded_copies); the codes where no kernel runs."""
    from jaxhq.ffi.dispatch import quantize_copies
    return jax.jit(lambda t: quantize_copies(t, fmt, ("rowwise",), decoded=("rowwise",))["rowwise"])


def _grouped(kernel="auto", fast_accum=False):
    """A jitted grouped GEMM (a, stacked weights, group sizes) -> bf16 on `kernel`."""
    return jax.jit(lambda a, bs, gs: G.grouped_gemm(a, bs, gs, jnp.bfloat16, kernel=kernel, fast_accum=fast_accum))


def variants(m, k, n, key, xla_scaled=False):
    """{name: (jitted fn, args[, environment variables set while it is timed])}; operands built on the device."""
    ka, kb = jax.random.split(key)
    x = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kb, (n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    v = {}
    v["xla_bf16"] = (jax.jit(lambda a, b: lax.dot_general(a, b, TN)), (x, w))
    if m % GROUPS == 0:  # XLA's own grouped GEMM (what a JAX MoE has without jaxhq): bf16 ragged_dot, [G, K, N]
        wt = jnp.stack([jnp.roll(w, i, axis=0).T for i in range(GROUPS)])
        v[f"xla_bf16_ragged_dot_grouped{GROUPS}"] = (
            jax.jit(lambda a, b, gs: lax.ragged_dot(a, b, gs, preferred_element_type=jnp.bfloat16)),
            (x, wt, jnp.full((GROUPS,), m // GROUPS, jnp.int32)))
        ident = Identity(jnp.bfloat16)  # jaxhq's bf16 grouped GEMM (CUTLASS, sizes on the device), the same groups
        v[f"jaxhq_bf16_grouped{GROUPS}"] = (
            _grouped(),
            (_quantizer(ident)(x), G.stack_storages([_quantizer(ident)(jnp.roll(w, i, axis=0)) for i in range(GROUPS)]),
             jnp.full((GROUPS,), m // GROUPS, jnp.int32)))

    qa = _quantizer(Float8CurrentScaling("e4m3"))(x)
    qb = _quantizer(Float8CurrentScaling("e4m3"))(w)
    v["xla_fp8_dot_general"] = (jax.jit(lambda a, b: lax.dot_general(a, b, TN, preferred_element_type=jnp.bfloat16)),
                                (qa.data, qb.data))
    if xla_scaled:  # XLA's autotuning of the scaled FP8 dot compiles for ~100 s per shape
        v["xla_fp8_scaled(ops.gemm)"] = (jax.jit(lambda a, b: fp8_gpu_dot(a, b, jnp.bfloat16)), (qa, qb))
    v["jaxhq_fp8_tensor"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16)), (qa, qb))
    v["jaxhq_fp8_tensor_fastacc"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16, fast_accum=True)), (qa, qb))

    ba = _quantizer(Float8Block((1, 128)))(x)
    bb = _quantizer(Float8Block((128, 128)))(w)
    v["jaxhq_fp8_block"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16)), (ba, bb))
    b1d = _quantizer(Float8Block((1, 128)))(w)
    v["jaxhq_fp8_block_1d1d"] = (jax.jit(lambda a, b: G.fp8_gemm(a, b, jnp.bfloat16)), (ba, b1d))  # wgrad's scaling
    if k % (GROUPS * 128) == 0:  # the MoE wgrad: K (the tokens) in GROUPS segments, out [GROUPS, M, N]
        v[f"jaxhq_fp8_block_1d1d_segment{GROUPS}"] = (jax.jit(lambda a, b, s: G.segment_gemm(a, b, s)),
                                                      (ba, b1d, jnp.full((GROUPS,), k // GROUPS, jnp.int32)))
        # one segment of all K: the dense 1d1d GEMM on CUTLASS's kernel instead of cuBLASLt's
        v["jaxhq_fp8_block_1d1d_segment1"] = (jax.jit(lambda a, b, s: G.segment_gemm(a, b, s)),
                                              (ba, b1d, jnp.full((1,), k, jnp.int32)))
    # the dense GEMM on CUTLASS's grouped kernels, one group of all M rows (against cuBLASLt's dense kernel)
    one = jnp.full((1,), m, jnp.int32)
    for label, qa_, qb_, fast in (("tensor", qa, qb, False), ("tensor_fastacc", qa, qb, True), ("block", ba, bb, False)):
        v[f"jaxhq_fp8_{label}_cutlass1"] = (_grouped("cutlass", fast), (qa_, G.stack_storages([qb_]), one))
    if m % GROUPS == 0:  # MoE: GROUPS experts of m / GROUPS rows each, same FLOPs as the dense GEMM
        sizes = jnp.full((GROUPS,), m // GROUPS, jnp.int32)
        for fmt, qa_, label in ((Float8CurrentScaling("e4m3"), qa, "tensor"), (Float8Block((128, 128)), ba, "block")):
            wq = G.stack_storages([_quantizer(fmt)(jnp.roll(w, i, axis=0)) for i in range(GROUPS)])
            paths = [("", "auto", False, {}), ("_wgmma", "wgmma", False, {}),
                     ("_unpaired", "wgmma", False, {"JAXHQ_WGMMA_CLUSTER": "1"}), ("_lt", "cublaslt", False, {})]
            if label == "tensor":  # "auto" is CUTLASS's kernel where built
                paths.append(("_fastacc", "auto", True, {}))
            for suffix, kern, fast, env in paths:
                v[f"jaxhq_fp8_{label}_grouped{GROUPS}{suffix}"] = (_grouped(kern, fast), (qa_, wq, sizes), env)

    ma = _quantizer(MXFP8("e4m3"))(x)
    mb = _quantizer(MXFP8("e4m3"))(w)
    wg = "wgmma" if G._hopper() else "auto"  # the FP8-wgmma kernel wherever it runs
    v["jaxhq_mxfp8"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel=wg)), (ma, mb))
    v["jaxhq_mxfp8_dq"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel="dequantize")),
                           (ma, mb))
    if m % GROUPS == 0:  # MoE: GROUPS experts of m / GROUPS rows each, same FLOPs as the dense GEMM
        wq = G.stack_storages([_quantizer(MXFP8("e4m3"))(jnp.roll(w, i, axis=0)) for i in range(GROUPS)])
        sizes = jnp.full((GROUPS,), m // GROUPS, jnp.int32)
        for label, kern, env in (("", wg, {}), ("_dq", "dequantize", {}),
                                 ("_dq_host", "dequantize", {"JAXHQ_DQ_GROUPED": "host"})):
            v[f"jaxhq_mxfp8_grouped{GROUPS}{label}"] = (_grouped(kern), (ma, wq, sizes), env)
    # decoded operands, as a training step hands them over on a Hopper: the dense and the grouped GEMM with no
    # dequantize pass (the grouped one against the dense one)
    dq = jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel="dequantize"))
    for label, fmt in (("mxfp8", MXFP8("e4m3")), ("nvfp4", NVFP4())):
        da = _decoded(fmt)(x)
        v[f"jaxhq_{label}_dq_decoded"] = (dq, (da, _decoded(fmt)(w)))
        if m % GROUPS == 0:
            wd = G.stack_storages([_decoded(fmt)(jnp.roll(w, i, axis=0)) for i in range(GROUPS)])
            v[f"jaxhq_{label}_grouped{GROUPS}_decoded"] = (_grouped("dequantize"),
                                                           (da, wd, jnp.full((GROUPS,), m // GROUPS, jnp.int32)))
    v["scaled_matmul_mxfp8"] = (
        jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None],
                                                          preferred_element_type=jnp.bfloat16)[0]),
        (ma.data, mb.data, ma.scale_inv, mb.scale_inv))

    na = _quantizer(NVFP4())(x)
    nb = _quantizer(NVFP4())(w)
    v["jaxhq_nvfp4"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel="dequantize")), (na, nb))
    if m % GROUPS == 0:  # MoE, as MXFP8's rows: the sizes on the device (CUTLASS), or read on the host
        wq = G.stack_storages([_quantizer(NVFP4())(jnp.roll(w, i, axis=0)) for i in range(GROUPS)])
        for label, env in (("_dq", {}), ("_dq_host", {"JAXHQ_DQ_GROUPED": "host"})):
            v[f"jaxhq_nvfp4_grouped{GROUPS}{label}"] = (
                _grouped("dequantize"), (na, wq, jnp.full((GROUPS,), m // GROUPS, jnp.int32)), env)
    if G._hopper() and k % 32 == 0:  # decoded on chip, fp16 wgmma
        v["jaxhq_nvfp4_wgmma"] = (jax.jit(lambda a, b: G.blockscaled_gemm(a, b, jnp.bfloat16, kernel="wgmma")),
                                  (na, nb))
    try:  # the same E2M1 values as jnp.float4_e2m1fn, E4M3 block scales (global scale left out)
        from jaxhq.formats.casts import e2m1_decode, unpack_nibbles
        to_f4 = jax.jit(lambda d: e2m1_decode(unpack_nibbles(d)).astype(jnp.float4_e2m1fn))
        fa, fb = to_f4(na.data), to_f4(nb.data)
        v["scaled_matmul_nvfp4"] = (
            jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None],
                                                              preferred_element_type=jnp.bfloat16)[0]),
            (fa, fb, na.scale_inv, nb.scale_inv))
    except Exception as e:  # noqa: BLE001
        print("scaled_matmul nvfp4 operands failed:", repr(e)[:200])
    return {name: _as_in_a_step(*entry) for name, entry in v.items()}


def _as_in_a_step(fn, args, *env):
    """A variant whose 1x128 and MXFP8 operands come as a training step hands them over: their scales held as the
    quantize launch wrote them and swapped to the Storage's layout inside the program, so the GEMM's own swap
    cancels against it (jaxhq_gemm_fp8, jaxhq_gemm_dq and the CUTLASS kernels then read them with no transpose
    kernel; Storages passed in as they are would cost one per call)."""
    if not any(as_launched(a) is not a for a in args):
        return (fn, args, *env)
    return (jax.jit(lambda *a: fn(*map(as_launched, a))), tuple(map(as_launched, args)), *env)


REF = {f"xla_bf16_ragged_dot_grouped{GROUPS}": "xla_bf16", f"jaxhq_bf16_grouped{GROUPS}": "xla_bf16",
       "jaxhq_fp8_tensor": "xla_fp8_dot_general", "jaxhq_fp8_tensor_fastacc": "xla_fp8_dot_general",
       "jaxhq_fp8_block_1d1d": "jaxhq_fp8_block", f"jaxhq_fp8_block_1d1d_segment{GROUPS}": "jaxhq_fp8_block_1d1d",
       "jaxhq_fp8_block_1d1d_segment1": "jaxhq_fp8_block_1d1d",
       **{f"jaxhq_fp8_{f}_cutlass1": f"jaxhq_fp8_{f}" for f in ("tensor", "tensor_fastacc", "block")},
       **{f"jaxhq_fp8_{f}_grouped{GROUPS}{s}": f"jaxhq_fp8_{f}" for f in ("tensor", "block")
          for s in ("", "_unpaired", "_lt", "_wgmma")},
       f"jaxhq_fp8_tensor_grouped{GROUPS}_fastacc": "jaxhq_fp8_tensor_fastacc",
       "jaxhq_mxfp8": "scaled_matmul_mxfp8", "jaxhq_mxfp8_dq": "scaled_matmul_mxfp8",
       f"jaxhq_mxfp8_grouped{GROUPS}": "jaxhq_mxfp8", f"jaxhq_mxfp8_grouped{GROUPS}_dq": "jaxhq_mxfp8_dq",
       f"jaxhq_mxfp8_grouped{GROUPS}_dq_host": "jaxhq_mxfp8_dq",
       "jaxhq_nvfp4": "scaled_matmul_nvfp4", "jaxhq_nvfp4_wgmma": "scaled_matmul_nvfp4",
       **{f"jaxhq_nvfp4_grouped{GROUPS}{s}": "jaxhq_nvfp4" for s in ("_dq", "_dq_host")},
       **{f"jaxhq_{f}_dq_decoded": "xla_bf16" for f in ("mxfp8", "nvfp4")},
       **{f"jaxhq_{f}_grouped{GROUPS}_decoded": f"jaxhq_{f}_dq_decoded" for f in ("mxfp8", "nvfp4")}}
COLUMNS = ["M", "K", "N", "kernel", "ms", "tflops", "x_bf16", "x_ref", "ref"]


def chained(fn, args: tuple, n: int):
    """(program, its arguments): n calls of fn in one jitted program, each on its own copy of args."""
    copies = [args] + [jax.tree.map(lambda t: jnp.array(t, copy=True), args) for _ in range(n - 1)]
    return jax.jit(lambda cs: [fn(*c) for c in cs]), (copies,)


def _shape(text: str) -> tuple:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not MxKxN (e.g. 8192x8192x8192)") from None
    return m, k, n


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=None, help="comma-separated MxKxN list (default: the four shapes above)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds over all variants (median per variant)")
    p.add_argument("--xla-scaled", action="store_true", help="also time XLA's scaled FP8 dot (jaxhq's XLA FP8 path)")
    p.add_argument("--chain", type=int, default=1, help="calls per jitted program, each on its own operands' copy")
    p.add_argument("--kernels", default=None,
                   help="comma-separated substrings: time only the variants whose name holds one (xla_bf16 and each "
                        "kept variant's reference always run)")
    args = p.parse_args()
    if args.shapes:
        shapes = [_shape(t) for t in args.shapes.split(",") if t]
    else:
        shapes = [(1024, 1024, 1024)] if args.quick else SHAPES
    rows = []
    key = jax.random.PRNGKey(0)
    for (m, k, n) in shapes:
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        vs = variants(m, k, n, sub, args.xla_scaled)
        if args.kernels:
            keep = {name for name in vs if any(w in name for w in args.kernels.split(","))} | {"xla_bf16"}
            keep |= {REF[name] for name in keep if name in REF}
            vs = {name: entry for name, entry in vs.items() if name in keep}
        if args.chain > 1:
            vs = {name: chained(fn, a, args.chain) + tuple(env) for name, (fn, a, *env) in vs.items()}
        print(f"{m}x{k}x{n}: operands in {time.perf_counter() - t0:.1f} s", flush=True)
        base, times, failed = {}, {name: [] for name in vs}, set()
        for name, (fn, a, *env) in vs.items():  # compile (and tune) every variant first
            t0 = time.perf_counter()
            try:
                with environ(*env):
                    jax.block_until_ready(fn(*a))
            except Exception as e:  # noqa: BLE001
                print(f"{name} {m}x{k}x{n} failed: {repr(e)[:300]}", flush=True)
                failed.add(name)
            print(f"  {name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(args.rounds):  # then time them in turn, round after round: drift hits all alike
            for name, (fn, a, *env) in vs.items():
                if name not in failed:
                    with environ(*env):
                        times[name].append(time_back_to_back(fn, *a)[0] / args.chain)
        for name in vs:
            t = sorted(times[name])[len(times[name]) // 2] if times[name] else None
            tf = None if t is None else 2.0 * m * n * k / t / 1e12
            base[name] = tf
            rows.append({"M": m, "K": k, "N": n, "kernel": name, "chain": args.chain,
                         "ms": None if t is None else t * 1e3, "tflops": tf,
                         "tflops_rounds": [round(2.0 * m * n * k / x / 1e12, 1) for x in times[name]]})
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
