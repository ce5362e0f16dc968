"""The GEMM dispatch table: (format of A, format of B, platform) -> implementation of A @ B.T.

Both operands are storages laid out K-major (data [M, K] and [N, K], blocks along K; a decoded B may instead be
another copy read transposed, `Storage.transposed`, data [K, N]: see shares_transposed_copy). The CPU entries are
exact: dequantize to fp32 and `dot_general` with fp32 accumulation (Identity pairs are a plain dot in the
input dtype, so the bf16 recipe is bit-identical to `x @ w`). GPU kernels register themselves in the same
table. A pair with no entry raises at trace time, naming the GEMM, both roles and both formats, unless the
caller allows the dequantized fallback.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from ..formats import COLUMNWISE, ROWWISE, Storage
from ..formats.nvfp4 import NVFP4

TN = (((1,), (1,)), ((), ()))  # contract the last axis of both operands
_TABLE: dict = {}


class GemmError(TypeError):
    pass


def family(s: Storage) -> str:
    """The format family a kernel is written for ("fp8" covers current and delayed, E4M3 and E5M2)."""
    return {"fp8_delayed": "fp8"}.get(s.quantizer.name, s.quantizer.name)


def register(fa: str, fb: str, fn: Callable, platform: str = "any") -> None:
    """Register `fn(a, b, out_dtype) -> a @ b.T` for the (fa, fb) pair on a platform ("cpu", "gpu", "any")."""
    _TABLE[(fa, fb, platform)] = fn


def lookup(fa: str, fb: str, platform: str) -> Optional[Callable]:
    return _TABLE.get((fa, fb, platform)) or _TABLE.get((fa, fb, "any"))


def dequantized_dot(a: Storage, b: Storage, out_dtype):
    """Exact reference: dequantize both operands to fp32, contract with fp32 accumulation."""
    if isinstance(a.quantizer, NVFP4) and isinstance(b.quantizer, NVFP4) and \
            a.quantizer.uses_rht(a.axis) and b.quantizer.uses_rht(b.axis):
        av, bv = a.quantizer.dequantize_transformed(a), b.quantizer.dequantize_transformed(b)  # RHT cancels
    else:
        av, bv = a.dequantize(), b.dequantize()
    out = lax.dot_general(av, bv, TN, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def identity_dot(a: Storage, b: Storage, out_dtype):
    """Both operands in high precision: the plain dot XLA would run for `x @ w`."""
    return lax.dot_general(a.data, b.data, TN).astype(out_dtype)


def mixed_identity_dot(a: Storage, b: Storage, out_dtype):
    """One operand in high precision: dequantize the other to its dtype and run a plain dot."""
    hp = a if a.quantizer.name == "identity" else b
    dt = hp.data.dtype
    av = a.data if a is hp else a.dequantize().astype(dt)
    bv = b.data if b is hp else b.dequantize().astype(dt)
    return lax.dot_general(av, bv, TN, preferred_element_type=jnp.float32).astype(out_dtype)


def fp8_gpu_dot(a: Storage, b: Storage, out_dtype):
    """FP8 per-tensor on GPU where no kernel applies (e.g. E5M2 x E5M2): the FP8 values exactly in bf16, an fp32
    accumulating dot, then both per-tensor scales applied to the fp32 result (no rounding of the scales)."""
    acc = lax.dot_general(a.data.astype(jnp.bfloat16), b.data.astype(jnp.bfloat16), TN,
                          preferred_element_type=jnp.float32)
    return (acc * (a.scale_inv.astype(jnp.float32) * b.scale_inv.astype(jnp.float32))).astype(out_dtype)


QUANTIZED = ("fp8", "mxfp8", "nvfp4", "fp8_block")
for _f in QUANTIZED:
    register(_f, _f, dequantized_dot)
    register("identity", _f, mixed_identity_dot)
    register(_f, "identity", mixed_identity_dot)
register("identity", "identity", identity_dot)


def platform() -> str:
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


# The per-tensor FP8 GEMMs that use Hopper's fast accumulation (no periodic promotion to fp32 inside the tensor
# cores; XLA's FP8 dot does the same): the forward and dgrad, which contract over features. Its error
# (docs/gemm.md) is far below the FP8 rounding of the operands, and three seeds of the small model trained as
# well with it as without (docs/training.md). wgrad, which contracts over every token of the step, keeps the
# promoted accumulation: fast there, the same runs ended 2.3% above bf16's validation loss.
# JAXHQ_FP8_FAST_ACCUM="forward" (or "", or "forward,dgrad,wgrad") overrides, for A/B runs.
FAST_ACCUM = ("forward", "dgrad")


def fast_accum_gemms() -> tuple:
    spec = os.environ.get("JAXHQ_FP8_FAST_ACCUM")
    return FAST_ACCUM if spec is None else tuple(t.strip() for t in spec.split(",") if t.strip())


# The formats whose copies are written decoded where the GEMMs dequantize (decoded_copies), by the H100 training
# step (benchmarks/train_step.py --paths, one process, three rounds, 2026-11-26, decoded against codes): mxfp8
# 1.031x -> 1.010x bf16 (quick preset 1.226x -> 1.156x); nvfp4 1.102x -> 1.071x (quick 1.504x -> 1.437x) once its
# decoded elements came from the rounding itself (decoding the codes, it gained nothing: 1.112x both ways).
DECODED_FAMILIES = ("mxfp8", "nvfp4")
# The dense op's saved copies written decoded by default (saved_decoded), chosen by the H100 preset's step (H200,
# 2026-11-29, two rounds, step and peak memory vs bf16 for none / input / weight / both): mxfp8 0.985 / 0.964 / 0.970
# / 0.955 with memory 0.962 / 0.994 / 1.011 / 1.038; hybrid:mxfp8:nvfp4 1.049 / 1.038 / 1.041 / 1.027 with 0.928 /
# 0.980 / 0.996 / 1.041. The input's: the most time within bf16's memory. nvfp4, whose weights already save their
# decoded copy: 1.046 / 1.031 with memory 0.996 / 1.041 for none / input, so it keeps the input's codes.
SAVED_DECODED = ("input",)


def decoded_copies(quantizer, usage) -> tuple:
    """The copies among `usage` that the quantize kernels write decoded (bf16 values, `Storage.decoded`) because
    the GEMM that reads them dequantizes its operands first: the block-scaled GEMMs on Hopper (compute capability
    9: a dequantize pass to bf16, then a bf16 GEMM) and the CPU handlers (JAXHQ_KERNELS=all), for the formats of
    DECODED_FAMILIES. Writing the values once saves the pass its read of the codes and a launch. The dense op asks
    this for the copies its GEMMs read at once (the forward's, the gradient's), and for the ones the backward
    keeps only as saved_decoded says (codes are smaller). JAXHQ_DECODED=0 turns it off, 1 asks for it for MXFP8
    and NVFP4 whatever DECODED_FAMILIES holds (A/B timing and tests); a family whose GEMMs run on a wgmma kernel
    that reads codes (JAXHQ_MXFP8_GEMM / JAXHQ_NVFP4_GEMM = wgmma) keeps its codes."""
    from ..formats.hybrid import side
    mode = os.environ.get("JAXHQ_DECODED", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"JAXHQ_DECODED must be auto, 0 or 1, got {mode!r}")
    if mode == "0" or not _decoding_gemm(mode):
        return ()
    fams = ("mxfp8", "nvfp4") if mode == "1" else DECODED_FAMILIES
    for fam, var in (("mxfp8", "JAXHQ_MXFP8_GEMM"), ("nvfp4", "JAXHQ_NVFP4_GEMM")):
        if os.environ.get(var) == "wgmma":  # that kernel reads codes
            fams = tuple(f for f in fams if f != fam)
    return tuple(a for a in usage if side(quantizer, a).name in fams)


def saved_decoded(quantizer, slot: str, weight=None) -> tuple:
    """The backward's copy (COLUMNWISE, or nothing) of the dense op's `slot` ("input": wgrad's operand, "weight":
    dgrad's) that its forward writes decoded and saves, so that the backward GEMM reads it without a dequantize
    pass, at the price of a bf16 residual (the size of bf16's own) instead of codes; for the families whose GEMMs
    dequantize (decoded_copies). By default (SAVED_DECODED) the input's, unless the op's `weight` quantizer
    already saves a bf16 copy (shares_transposed_copy): one such residual per op, as bf16's step keeps x.
    JAXHQ_DECODED_RESIDUALS names the slots instead ("input,weight", "input", "weight"; "0": none, "1": both)."""
    spec = os.environ.get("JAXHQ_DECODED_RESIDUALS")
    if spec is None:
        slots = SAVED_DECODED if weight is None or not shares_transposed_copy(weight) else ()
    else:
        slots = {"0": (), "1": ("input", "weight")}.get(spec, tuple(t.strip() for t in spec.split(",") if t.strip()))
    if any(t not in ("input", "weight") for t in slots):
        raise ValueError(f"JAXHQ_DECODED_RESIDUALS must be 0, 1 or slots among input,weight, got {spec!r}")
    return decoded_copies(quantizer, (COLUMNWISE,)) if slot in slots else ()


def shares_transposed_copy(quantizer) -> bool:
    """Whether the dense op's dgrad reads the weight's forward copy transposed instead of a columnwise copy of its
    own: where both copies are the same NVFP4 16x16-block quantization (no Hadamard transform, no stochastic
    rounding), the columnwise copy holds the rowwise one's values transposed, and where that copy is decoded
    (decoded_copies) the bf16 GEMM reads it in either layout (`Storage.transposed`). The weight's launch then
    makes one copy instead of two, and the dgrad GEMM no dequantize pass; the saved copy is the decoded one (bf16,
    as bf16's own saved weight) instead of codes. JAXHQ_TRANSPOSED_COPY=0 turns it off (A/B timing)."""
    from ..formats.hybrid import side
    if os.environ.get("JAXHQ_TRANSPOSED_COPY", "1") == "0":
        return False
    q = side(quantizer, ROWWISE)
    return (isinstance(q, NVFP4) and q == side(quantizer, COLUMNWISE) and q.block_2d and not q.rht
            and not q.stochastic_rounding and decoded_copies(quantizer, (ROWWISE,)) == (ROWWISE,))


def _decoding_gemm(mode: str) -> bool:
    """Whether this platform's MXFP8 / NVFP4 GEMMs dequantize their operands (see decoded_copies)."""
    from ..ffi import gemm as K
    if platform() == "cpu":
        return cpu_kernels_on()
    return K.available() and K._hopper()


def _with_fallback(kernel, fallback):
    """A table entry: the FFI kernel where it applies, else the previously registered implementation. The
    kernel runs as a partitioned call (jaxhq.ffi.partitioning.gemm): under a mesh each device multiplies its
    own shards, and a contraction split across devices is reduced, so no operand is gathered to fit the call."""
    from ..ffi import partitioning
    from ..ffi.gemm import GemmUnsupported

    def fn(a: Storage, b: Storage, out_dtype):
        try:  # trace-time check only: the kernel raises for operands it does not take
            jax.eval_shape(lambda a, b: kernel(a, b, out_dtype), a, b)
        except GemmUnsupported:
            return fallback(a, b, out_dtype)
        return partitioning.gemm(kernel, a, b, out_dtype)
    fn.__name__ = f"gpu_{getattr(kernel, '__name__', 'kernel')}"
    fn._jaxhq_ffi_gemm = True
    fn._fallback = fallback
    return fn


def gpu_kernels() -> dict:
    """{(format of A, format of B): FFI kernel} for the pairs whose kernel passed tests/test_gemm_gpu.py on an H100
    (the same targets have exact CPU handlers, used under JAXHQ_KERNELS=all; see `cpu_kernels_on`)."""
    from ..ffi import gemm as K
    return {("fp8", "fp8"): K.fp8_gemm, ("fp8_block", "fp8_block"): K.fp8_gemm,
            ("mxfp8", "mxfp8"): K.blockscaled_gemm, ("nvfp4", "nvfp4"): K.blockscaled_gemm}


def register_gpu_gemms() -> list:
    """Registers the FFI kernels (jaxhq.ffi.gemm) for platform "gpu", each falling back to the entry it
    replaces; returns the pairs. Does nothing (returns []) without a GPU or unbuilt kernels. Idempotent."""
    from ..ffi import gemm as K
    if not K.available():
        return []
    done = []
    for (fa, fb), kernel in gpu_kernels().items():
        prev = lookup(fa, fb, "gpu")
        if not getattr(prev, "_jaxhq_ffi_gemm", False):
            register(fa, fb, _with_fallback(kernel, prev or dequantized_dot), platform="gpu")
        done.append((fa, fb))
    return done


def cpu_kernels_on() -> bool:
    """Whether the GEMMs on the CPU run the FFI targets' CPU handlers (JAXHQ_KERNELS=all, the tests' mode: the
    CPU program then holds the same custom calls, partitioned the same way, as a GPU one)."""
    from ..ffi import gemm as K
    from ..formats.quantize import kernel_platforms
    return "cpu" in kernel_platforms() and K._registered("cpu")


@functools.lru_cache(maxsize=None)
def _register_gpu_kernels() -> tuple:
    return tuple(register_gpu_gemms())


def gemm(a: Storage, b: Storage, out_dtype, *, name: str = "gemm", roles=(None, None), fallback: bool = False):
    """A @ B.T through the dispatch table; `name` (forward/dgrad/wgrad) and roles only label errors."""
    if a.shape[1] != b.shape[1]:
        raise GemmError(f"{name} GEMM: contraction sizes differ: A {a.shape} ({a.format}, role {roles[0]}) and "
                        f"B {b.shape} ({b.format}, role {roles[1]})")
    fa, fb = family(a), family(b)
    if platform() == "gpu":
        _register_gpu_kernels()
    fn = lookup(fa, fb, platform())
    if platform() == "cpu" and (fa, fb) in gpu_kernels() and cpu_kernels_on():
        fn = _with_fallback(gpu_kernels()[(fa, fb)], fn or dequantized_dot)
    if getattr(fn, "_jaxhq_ffi_gemm", False) and fa == fb == "fp8" and name in fast_accum_gemms():
        from ..ffi import gemm as K
        fn = _with_fallback(functools.partial(K.fp8_gemm, fast_accum=True), fn._fallback)
    if fn is None:
        if not fallback:
            raise GemmError(
                f"{name} GEMM has no implementation for A = {a.format} (role {roles[0]}) x B = {b.format} "
                f"(role {roles[1]}) on {platform()}; choose matching formats for these roles or build the recipe "
                "with allow_dequantized_fallback=True")
        fn = dequantized_dot
    return fn(a, b, out_dtype)


register("fp8", "fp8", fp8_gpu_dot, platform="gpu")
