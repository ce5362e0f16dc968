"""GPU GEMM kernels through XLA FFI: A @ B.T on the quantized storages exactly as the quantizers lay them out.

`fp8_gemm` (per-tensor FP8, and FP8 blockwise 1x128 / 128x128) runs one cuBLASLt FP8 GEMM that reads the
scales on the device; `blockscaled_gemm` dequantizes MXFP8 and NVFP4 operands exactly to bf16 in a workspace and
runs a cuBLASLt bf16 GEMM (the NVFP4 global scales as a device-side alpha), or, with `kernel="wgmma"` on a Hopper,
runs MXFP8 on FP8 tensor cores (the 1x32 scales applied in FP32 registers per K step) and NVFP4 on fp16 tensor
cores with the codes decoded in shared memory (no bf16 copy in HBM). Each takes
an optional bias [N] and an optional `accumulate` array [M, N] that the result is added into (aliased, for
wgrad accumulation). `grouped_gemm` runs the ragged MoE version of either in one FFI call, `segment_gemm` the
MoE wgrad (grouped along K).
This module does not know the dispatch table: `jaxhq.ops.gemm` imports it and registers these kernels
(the dependency runs one way). Operands a kernel cannot take raise `GemmUnsupported`. See docs/gemm.md.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..formats import Storage
from .dispatch import launch_scales

FP8_TARGET, DQ_TARGET, MX_TARGET, NV_TARGET = "jaxhq_gemm_fp8", "jaxhq_gemm_dq", "jaxhq_gemm_mxfp8", "jaxhq_gemm_nvfp4"
KERNELS = ("auto", "wgmma", "dequantize")  # the MXFP8 / NVFP4 kernel choices of blockscaled_gemm / grouped_gemm
FP8_GROUPED_KERNELS = ("auto", "wgmma", "cublaslt", "cutlass")  # grouped_gemm's choices for per-tensor / blockwise FP8
FP8_WGMMA_GROUPED = "jaxhq_gemm_fp8_wgmma_grouped"
FP8_CUTLASS_GROUPED = "jaxhq_gemm_fp8_cutlass_grouped"
CUTLASS_KGROUPED = "jaxhq_gemm_cutlass_kgrouped"
BF16_CUTLASS_GROUPED = "jaxhq_gemm_bf16_cutlass_grouped"
MODE_TENSOR, MODE_VEC128, MODE_BLK128 = 0, 1, 2
FMT_MX_E4M3, FMT_MX_E5M2, FMT_NVFP4 = 1, 2, 3
# cuBLASLt's block-scale layout: 1x128 scales M-major [K/128, roundup(M, 4)] (jaxhq_gemm_fp8 takes them
# [K/128, M], _fp8_scales), 128x128 scales K-major
# [N/128, roundup(K/128, 4)]. JAXHQ_GEMM_SCALE_LAYOUT="layout,pad" overrides (probing only).
DEFAULT_LAYOUT = "0,4"


def _layout() -> tuple:
    return tuple(int(v) for v in os.environ.get("JAXHQ_GEMM_SCALE_LAYOUT", DEFAULT_LAYOUT).split(","))


class GemmUnsupported(ValueError):
    """The kernel does not take these operands (format pair, shape or alignment); callers fall back."""


def _registered(platform: str = None) -> bool:
    """True when the extension has the GEMM targets registered for `platform` ("cuda" or "cpu"; default: the
    default backend's). The CPU handlers are simple exact loops (tests and sharding checks, not speed)."""
    from . import load, registered_targets
    platform = platform or ("cuda" if jax.default_backend() in ("gpu", "cuda") else "cpu")
    return load() is not None and FP8_TARGET in registered_targets().get(platform, [])


def available() -> bool:
    """True when the GEMM kernels are built and a GPU backend is present."""
    try:
        has_gpu = any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False
    return has_gpu and _registered("cuda")


def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _out_tail(m: int, n: int, out_dtype, bias, accumulate, name: str):
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise GemmUnsupported(f"{name}: output dtype {out_dtype} (float32 or bfloat16 needed)")
    if n % (4 if out_dtype == jnp.float32 else 8):
        raise GemmUnsupported(f"{name}: N = {n} breaks the 16-byte alignment of the output rows")
    b = _empty(out_dtype) if bias is None else jnp.asarray(bias, out_dtype).reshape(n)
    if accumulate is None:
        return out_dtype, b, _empty(out_dtype), {}
    if accumulate.shape != (m, n):
        raise GemmUnsupported(f"{name}: accumulate is {accumulate.shape}, expected {(m, n)}")
    return out_dtype, b, accumulate.astype(out_dtype), {5: 0}


# The dense GEMM targets take their temporaries from a workspace result (uint8 [bytes]) that XLA allocates with
# the call, so they can live in XLA's CUDA graphs. Its size covers every path the handler may take
# (csrc/gemm/gemm_handlers.cc; each piece is rounded to 256 bytes): the cuBLASLt workspace, block-scale
# re-layouts, dequantized operands, the unfused epilogue's temporary (bias or accumulate), and the retry with
# A's rows padded to 16 (cuBLASLt refused block-scaled FP8 only for M % 16 != 0). A handler that runs out
# says how many bytes it needed.
def _lt_workspace() -> int:
    """The handlers' cuBLASLt workspace bytes, as the extension states them (gemm/bindings.h)."""
    from . import load
    return int(load().lt_workspace_bytes)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _piece(nbytes: int) -> int:
    return max(_cdiv(int(nbytes), 256) * 256, 256)


def _scale_piece(mode: int, rows: int, k: int, pad: int) -> int:
    """Bytes of one operand's re-laid block scales (or the aligned copy of a per-tensor scale)."""
    if mode == MODE_TENSOR:
        return _piece(4)
    kb, sr = _cdiv(k, 128), rows if mode == MODE_VEC128 else _cdiv(rows, 128)
    pad = max(pad, 1)
    return _piece(4 * max(_cdiv(sr, pad) * pad * kb, sr * _cdiv(kb, pad) * pad))


def _epilogue_pieces(m: int, n: int, out_bytes: int, fused_extra: bool, a_row_bytes: int) -> int:
    """The unfused epilogue's temporary (with a bias or accumulate) and the padded retry (M % 16 != 0)."""
    total = _piece(m * n * out_bytes) + _piece(8) if fused_extra else 0
    if m % 16:
        mp = _cdiv(max(m, 1), 16) * 16
        total += _piece(mp * a_row_bytes) + _piece(mp * n * out_bytes) + _piece(8)
    return total


def workspace_bytes_fp8(m, n, k, mode_a, mode_b, out_dtype, extra: bool, layout=None) -> int:
    """Workspace of jaxhq_gemm_fp8 for A [m, k], B [n, k]; `extra`: a bias or accumulate is given."""
    pad = (layout or _layout())[1]
    ob = jnp.dtype(out_dtype).itemsize
    total = 256 + _lt_workspace() + _scale_piece(mode_a, m, k, pad) + _scale_piece(mode_b, n, k, pad)
    if m % 16:  # the retry re-lays A's scales for the padded rows
        total += _scale_piece(mode_a, _cdiv(max(m, 1), 16) * 16, k, pad)
    return total + _epilogue_pieces(m, n, ob, extra, k)


def workspace_bytes_dq(m, n, k, nvfp4: bool, out_dtype, extra: bool, decoded=(False, False)) -> int:
    """Workspace of jaxhq_gemm_dq: bf16 copies of both operands (Hopper; none for a decoded operand, which is
    read where it lies), or their block scales swizzled for cuBLASLt (Blackwell), whichever is larger; the NVFP4
    alpha; the epilogue and retry pieces."""
    ob = jnp.dtype(out_dtype).itemsize
    cols = _cdiv(k, 16 if nvfp4 else 32)
    swizzled = 0 if any(decoded) else sum(_piece(_cdiv(r, 128) * 128 * _cdiv(cols, 4) * 4) for r in (m, n))
    operands = max(sum(_piece(r * k * 2) for r, d in zip((m, n), decoded) if not d), swizzled)
    return 256 + _lt_workspace() + operands + _piece(8) + _epilogue_pieces(m, n, ob, extra, 2 * k)


def _workspace(nbytes: int):
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


def _fp8_mode(s: Storage, name: str) -> int:
    q = s.quantizer
    if q.name in ("fp8", "fp8_delayed"):
        return MODE_TENSOR
    if q.name == "fp8_block":
        return MODE_VEC128 if tuple(q.block) == (1, 128) else MODE_BLK128
    raise GemmUnsupported(f"{name}: {s.format} is not an FP8 per-tensor or blockwise storage")


def _fp8_scales(s: Storage):
    """An operand's scales as jaxhq_gemm_fp8 takes them: as the quantize launch wrote them (dispatch.launch_scales:
    1x128 ones [ceil(K/128), rows], the layout cuBLASLt reads), float32."""
    return jnp.asarray(launch_scales(s), jnp.float32)


def fp8_gemm(a: Storage, b: Storage, out_dtype=jnp.bfloat16, *, bias=None, accumulate=None,
             fast_accum: bool = False):
    """A @ B.T (+ bias) (+ accumulate) for FP8 per-tensor or blockwise storages (A [M, K], B [N, K]).

    Per-tensor: E4M3xE4M3, E4M3xE5M2, E5M2xE4M3; blockwise: 1x128 x 128x128, 1x128 x 1x128, 128x128 x 1x128.
    fast_accum uses Hopper's faster reduced-precision FP8 accumulation (off by default).
    """
    name = "fp8 GEMM"
    if a.transposed or b.transposed:
        raise GemmUnsupported(f"{name}: FP8 operands are read K-major, not as transposed copies")
    ma, mb = _fp8_mode(a, name), _fp8_mode(b, name)
    (m, k), (n, kb) = a.data.shape, b.data.shape
    if k != kb:
        raise GemmUnsupported(f"{name}: K differs: A {a.data.shape} ({a.format}), B {b.data.shape} ({b.format})")
    if (ma == MODE_TENSOR) != (mb == MODE_TENSOR) or ma == mb == MODE_BLK128:
        raise GemmUnsupported(f"{name}: no kernel for {a.format} x {b.format}")
    if a.data.dtype == b.data.dtype == jnp.float8_e5m2:
        raise GemmUnsupported(f"{name}: E5M2 x E5M2 has no FP8 GEMM")
    if k % 16:
        raise GemmUnsupported(f"{name}: K = {k} is not a multiple of 16")
    out_dtype, bias_, c, aliases = _out_tail(m, n, out_dtype, bias, accumulate, name)
    if not _registered():
        raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
    ws = _workspace(workspace_bytes_fp8(m, n, k, ma, mb, out_dtype, bias is not None or accumulate is not None))
    call = jax.ffi.ffi_call(FP8_TARGET, (jax.ShapeDtypeStruct((m, n), out_dtype), ws),
                            input_output_aliases=aliases, vmap_method="sequential")  # vmap: a call per element
    return call(a.data, _fp8_scales(a), b.data, _fp8_scales(b), bias_, c, mode_a=np.int32(ma),
                mode_b=np.int32(mb), layout=np.int32(_layout()[0]), pad=np.int32(_layout()[1]),
                accumulate=np.int32(accumulate is not None), fast_accum=np.int32(fast_accum))[0]


def _dq_fmt(s: Storage, name: str) -> int:
    q = s.quantizer
    if q.name == "mxfp8":
        return FMT_MX_E5M2 if q.fmt == "e5m2" else FMT_MX_E4M3
    if q.name == "nvfp4":
        return FMT_NVFP4
    raise GemmUnsupported(f"{name}: {s.format} is not an MXFP8 or NVFP4 storage")


def _u8(x):
    return x if x.dtype == jnp.uint8 else lax.bitcast_convert_type(x, jnp.uint8)


def _dq_data(s: Storage):
    """An operand's data as jaxhq_gemm_dq(_grouped) takes it: codes as bytes, a decoded copy as its bf16 values
    (the handlers read those where they lie; their scales are not read)."""
    return s.data if s.decoded else _u8(s.data)


def _kernel_for_decoded(a: Storage, b: Storage, kernel: str, name: str) -> str:
    """`kernel` for a block-scaled pair: "dequantize" where an operand is decoded (its values are there already,
    and the bf16 GEMM of the dequantize path reads them where they lie); the wgmma kernels read codes only."""
    if not (a.decoded or b.decoded):
        return kernel
    if kernel == "wgmma":
        raise GemmUnsupported(f"{name}: the wgmma kernel reads codes, not decoded copies")
    return "dequantize"


def _dq_scales(s: Storage):
    """An operand's scales as jaxhq_gemm_dq(_grouped) takes them: as the quantize launch wrote them
    (dispatch.launch_scales: MXFP8 ones [..., ceil(K/32), rows], the handlers' rows_inner), as bytes."""
    return _u8(launch_scales(s))


@functools.lru_cache(maxsize=None)
def _hopper() -> bool:
    """True when the default GPU is a Hopper (compute capability 9.x), where the sm_90a wgmma kernel runs."""
    try:
        cc = str(getattr(jax.devices("gpu")[0], "compute_capability", ""))
    except RuntimeError:
        return False
    return cc.split(".")[0] == "9"


# Whether "auto" takes the wgmma kernel, per format family. Both pass every GPU test but are the slower paths
# (docs/gemm.md): MXFP8 on an H100 (2026-11-25, one run) wgmma 380-381 TFLOP/s against dequantize + bf16 695-723
# at 8192^3, 16384x4096x14336 and 8192x4096x28672, the H100-preset training step 81.2 ms against 53.6; NVFP4
# (2026-11-27) 478-480 against 697-701, the step 1.381x bf16 against 1.051x.
WGMMA_WINS = False
NVFP4_WGMMA_WINS = False


def _wgmma_unfit(n: int, k: int, groups: int = 0) -> str:
    """Why the FP8 wgmma kernel cannot take an [M, K] x [N, K] GEMM ("" when it can): its limits in
    fp8_wgmma.h (K % 16 for TMA rows, paired output stores, <= 1024 groups) and the GPU."""
    return (f"K = {k} is not a positive multiple of 16" if k <= 0 or k % 16 else f"N = {n} is odd" if n % 2
            else f"{groups} groups (at most 1024)" if groups > 1024
            else "the GPU is not a Hopper (sm_90a)" if not _hopper() else "")


def _settled(kernel: str, choices: tuple, why: str, name: str):
    """A `kernel` argument's choice of the FP8 wgmma kernel where it settles it: "wgmma" takes it (an error
    when `why` says it cannot), the other non-"auto" choices and "auto" where the kernel does not apply
    decline it; None for "auto" where it applies (the caller decides)."""
    if kernel not in choices:
        raise ValueError(f"{name}: kernel must be one of {choices}, got {kernel!r}")
    if kernel == "wgmma" and why:
        raise GemmUnsupported(f"{name}: the wgmma kernel does not apply: {why}")
    return kernel == "wgmma" if kernel != "auto" or why else None


def _use_wgmma(fa: int, fb: int, n: int, k: int, kernel: str, name: str, groups: int = 0) -> bool:
    """Whether a block-scaled pair runs on its wgmma kernel (MXFP8 on FP8 tensor cores, NVFP4 decoded on chip):
    `kernel` "auto" picks it where it applies (`_wgmma_unfit`; the NVFP4 kernel is dense only and needs K % 32
    == 0) and wins (WGMMA_WINS, NVFP4_WGMMA_WINS), "wgmma" requires it, "dequantize" never.
    JAXHQ_MXFP8_GEMM / JAXHQ_NVFP4_GEMM = wgmma|dequantize override "auto" process-wide where the kernel applies
    (A/B timing)."""
    nv = fa == FMT_NVFP4 and fb == FMT_NVFP4
    why = _wgmma_unfit(n, k, groups)
    if nv and not why:
        why = (f"{groups} groups (the NVFP4 kernel is dense)" if groups else
               f"K = {k} is not a multiple of 32" if k % 32 else "")
    elif not nv and (fa == FMT_NVFP4 or fb == FMT_NVFP4):
        why = "not MXFP8 x MXFP8 or NVFP4 x NVFP4"
    settled = _settled(kernel, KERNELS, why, name)
    if settled is not None:
        return settled
    var = "JAXHQ_NVFP4_GEMM" if nv else "JAXHQ_MXFP8_GEMM"
    env = os.environ.get(var, "auto")
    if env not in KERNELS:
        raise ValueError(f"{var} must be one of {KERNELS}, got {env!r}")
    return env == "wgmma" or (env == "auto" and (NVFP4_WGMMA_WINS if nv else WGMMA_WINS))


def _fp8_grouped_wgmma(n: int, k: int, groups: int, kernel: str, name: str) -> bool:
    """Whether a grouped per-tensor / blockwise FP8 GEMM runs on the FP8 wgmma kernel (group sizes read on the
    device): "auto" wherever it applies, "wgmma" requires it, "cublaslt" and "cutlass" never."""
    settled = _settled(kernel, FP8_GROUPED_KERNELS, _wgmma_unfit(n, k, groups), name)
    return True if settled is None else settled


# Whether "auto" takes CUTLASS's grouped kernels for per-tensor and blockwise FP8 where they apply (the
# hand-written wgmma kernel otherwise): see docs/gemm.md for the measurements.
CUTLASS_GROUPED_WINS = True


def _cutlass_grouped_unfit(a, b0, n: int, k: int, groups: int, out_dtype, bias, fast_accum: bool = False) -> str:
    """Why CUTLASS's grouped FP8 kernels (fp8_cutlass_grouped.h) cannot take this call ("" when they can): built
    only with CUTLASS's headers; per-tensor scales, or 1x128 A and 128x128 B scales (no fast accumulation), E4M3
    weights, bf16 out, no bias, K % 16, N % 8."""
    modes = (_fp8_mode(a, ""), _fp8_mode(b0, ""))
    return _cutlass_missing(FP8_CUTLASS_GROUPED) or (
            "1x128 weight scales" if modes == (MODE_VEC128, MODE_VEC128)
            else "fast accumulation with blockwise scales" if fast_accum and modes != (MODE_TENSOR, MODE_TENSOR)
            else "E5M2 weights" if b0.data.dtype != jnp.float8_e4m3fn
            else f"{jnp.dtype(out_dtype).name} output (bf16 only)" if jnp.dtype(out_dtype) != jnp.bfloat16
            else "a bias" if bias is not None
            else f"K = {k} is not a multiple of 16" if k % 16 else f"N = {n} is not a multiple of 8" if n % 8
            else f"{groups} groups (at most 1024)" if groups > 1024 else "")


def _cutlass_missing(target: str) -> str:
    """Why a CUTLASS target cannot run here ("" when it can): no CUDA GPU, an extension built without CUTLASS's
    headers, or a GPU other than a Hopper."""
    targets = _cuda_targets()
    return ("no CUDA GPU (or an extension built without CUDA)" if not targets
            else "the extension was built without CUTLASS" if target not in targets
            else "the GPU is not a Hopper (sm_90a)" if not _hopper() else "")


def _cuda_targets() -> list:
    from . import registered_targets
    return registered_targets().get("cuda", []) if jax.default_backend() in ("gpu", "cuda") else []


def _fp8_grouped_cutlass(a, b0, n, k, groups, out_dtype, bias, kernel: str, name: str, fast_accum=False) -> bool:
    """Whether a grouped FP8 GEMM runs on CUTLASS's kernel: "cutlass" requires it, "auto" takes it where it
    applies and wins (CUTLASS_GROUPED_WINS), the other choices never."""
    if kernel not in ("auto", "cutlass"):
        return False
    why = _cutlass_grouped_unfit(a, b0, n, k, groups, out_dtype, bias, fast_accum)
    if kernel == "cutlass" and why:
        raise GemmUnsupported(f"{name}: the CUTLASS kernel does not apply: {why}")
    return not why and (kernel == "cutlass" or CUTLASS_GROUPED_WINS)


def blockscaled_gemm(a: Storage, b: Storage, out_dtype=jnp.bfloat16, *, bias=None, accumulate=None,
                     kernel: str = "auto"):
    """A @ B.T (+ bias) (+ accumulate) for MXFP8 x MXFP8 (E4M3/E5M2) or NVFP4 x NVFP4 storages.

    The exact dequantize + bf16 GEMM, or the pair's wgmma kernel where it applies and `kernel` (or "auto", see
    `_use_wgmma`) asks for it. NVFP4 with the Hadamard transform on both operands contracts in the transformed
    domain (it cancels); on exactly one operand it is unsupported.
    """
    name = "block-scaled GEMM"
    fa, fb = _dq_fmt(a, name), _dq_fmt(b, name)
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise GemmUnsupported(f"{name}: K differs: A {a.shape} ({a.format}), B {b.shape} ({b.format})")
    if (fa == FMT_NVFP4) != (fb == FMT_NVFP4):
        raise GemmUnsupported(f"{name}: no kernel for {a.format} x {b.format}")
    if a.transposed or (b.transposed and not b.decoded):
        raise GemmUnsupported(f"{name}: A is a transposed copy, or B a transposed copy of codes (only a decoded B "
                              "is read transposed)")
    kernel = _kernel_for_decoded(a, b, kernel, name)
    if fa == FMT_NVFP4 and a.quantizer.uses_rht(a.axis) != b.quantizer.uses_rht(b.axis):
        raise GemmUnsupported(f"{name}: the Hadamard transform is on one operand only")
    if _use_wgmma(fa, fb, n, k, kernel, name):
        out_dtype, bias_, c, aliases = _out_tail(m, n, out_dtype, bias, accumulate, name)
        if not _registered():
            raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
        if fa == FMT_NVFP4:
            call = jax.ffi.ffi_call(NV_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype),
                                    input_output_aliases={7: 0} if aliases else {}, vmap_method="sequential")
            return call(_u8(a.data), _u8(a.scale_inv), jnp.asarray(a.amax, jnp.float32).reshape(()), _u8(b.data),
                        _u8(b.scale_inv), jnp.asarray(b.amax, jnp.float32).reshape(()), bias_, c, k=np.int64(k),
                        accumulate=np.int32(accumulate is not None))
        call = jax.ffi.ffi_call(MX_TARGET, jax.ShapeDtypeStruct((m, n), out_dtype), input_output_aliases=aliases,
                                vmap_method="sequential")
        return call(_u8(a.data), _u8(a.scale_inv), _u8(b.data), _u8(b.scale_inv), bias_, c, fmt_a=np.int32(fa),
                    fmt_b=np.int32(fb), k=np.int64(k), accumulate=np.int32(accumulate is not None))
    if fa == FMT_NVFP4:
        if k % 16:
            raise GemmUnsupported(f"{name}: NVFP4 needs K % 16 == 0, got {k}")
        amax_a, amax_b = jnp.asarray(a.amax, jnp.float32), jnp.asarray(b.amax, jnp.float32)
    else:
        if k % 8:
            raise GemmUnsupported(f"{name}: MXFP8 needs K % 8 == 0, got {k}")
        amax_a = amax_b = _empty(jnp.float32)
    out_dtype, bias_, c, aliases = _out_tail(m, n, out_dtype, bias, accumulate, name)
    if not _registered():
        raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
    aliases = {7: 0} if aliases else {}
    ws = _workspace(workspace_bytes_dq(m, n, k, fa == FMT_NVFP4, out_dtype, bias is not None or accumulate is not None,
                                       (a.decoded, b.decoded)))
    call = jax.ffi.ffi_call(DQ_TARGET, (jax.ShapeDtypeStruct((m, n), out_dtype), ws), input_output_aliases=aliases,
                            vmap_method="sequential")
    # b_kn: B's data is [K, N] (a transposed decoded copy: its scales are not read)
    return call(_dq_data(a), _dq_scales(a), amax_a, _dq_data(b), _dq_scales(b), amax_b, bias_, c,
                fmt_a=np.int32(fa), fmt_b=np.int32(fb), k=np.int64(k), accumulate=np.int32(accumulate is not None),
                b_kn=np.int32(b.transposed), rows_inner=np.int32(fa != FMT_NVFP4))[0]



def grouped_gemm(a: Storage, bs, group_sizes, out_dtype=jnp.bfloat16, *, bias=None, accumulate=None,
                 fast_accum: bool = False, kernel: str = "auto"):
    """Ragged grouped GEMM for MoE in one FFI call: out[t] = A[t] @ bs[g(t)].T for A [T, K] sorted by group,
    G weight storages [N, K] (one format) as a list, or as one Storage whose arrays carry a leading group axis
    (data [G, N, ...], e.g. the storages stacked once with `stack_storages`: a list is stacked on every call),
    group_sizes [G] int32 (rows past their sum give 0, or keep `accumulate`), bias [G, N].

    Per-tensor and blockwise FP8 on a Hopper: CUTLASS's grouped kernels by default where the extension has
    them and they apply (`_cutlass_grouped_unfit`; `kernel="cutlass"` requires them), else the FP8 wgmma kernel
    (`kernel="wgmma"`; MXFP8 takes it with `kernel="wgmma"` too); both read group_sizes on the device (no host
    synchronisation) and promote their sums every 128-wide K step, unless `fast_accum` (per-tensor, CUTLASS or
    cuBLASLt). The dequantize path of MXFP8 and NVFP4 on a Hopper with CUTLASS (bf16 out, no bias) runs CUTLASS's
    bf16 grouped kernel on the dequantized operands (NVFP4's global scales as per-group alphas), the sizes on the
    device too (JAXHQ_DQ_GROUPED=host: the cuBLASLt loop); decoded operands (`Storage.decoded`, A or the stacked
    weights) are read where they lie, with no dequantize pass.
    Two high-precision (Identity) bf16 operands: CUTLASS's bf16 grouped kernel, sizes on the device.
    `kernel="cublaslt"` and the other cases read the sizes on the host (one stream synchronisation).
    """
    name = "grouped GEMM"
    stacked = bs if isinstance(bs, Storage) else stack_storages(bs, name)
    if stacked.data.ndim != 3:
        raise GemmUnsupported(f"{name}: stacked weights need data [G, N, ...], got {stacked.data.shape}")
    b0 = jax.tree.map(lambda x: x[0], stacked)  # one group's storage, for the checks
    g = stacked.data.shape[0]
    sizes = jnp.asarray(group_sizes, jnp.int32).reshape(g)
    t = a.data.shape[0]
    if a.quantizer.name == "identity" and b0.quantizer.name == "identity":
        return _bf16_grouped(a, stacked, sizes, out_dtype, bias, accumulate, name)
    fp8_families = ("fp8", "fp8_delayed", "fp8_block")
    if a.quantizer.name in fp8_families and b0.quantizer.name in fp8_families:
        ma, mb = _fp8_mode(a, name), _fp8_mode(b0, name)
        (_, k), (n, kb) = a.data.shape, b0.data.shape
        if k != kb or k % 16 or ma == MODE_BLK128 or (ma == MODE_TENSOR) != (mb == MODE_TENSOR):
            raise GemmUnsupported(f"{name}: no kernel for {a.format} {a.data.shape} x {b0.format} {b0.data.shape}")
        if a.data.dtype == b0.data.dtype == jnp.float8_e5m2:
            raise GemmUnsupported(f"{name}: E5M2 x E5M2 has no FP8 GEMM")
        out_dtype, bias_, c, aliases = _grouped_tail(t, g, n, out_dtype, bias, accumulate, name, 6)
        if not _registered():
            raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
        operands = (a.data, jnp.asarray(a.scale_inv, jnp.float32), stacked.data,
                    jnp.asarray(stacked.scale_inv, jnp.float32), sizes, bias_, c)
        if _fp8_grouped_cutlass(a, b0, n, k, g, out_dtype, bias, kernel, name, fast_accum):
            from . import load
            ws = int(load().cutlass_grouped_workspace_bytes(g, t, n, k, a.data.dtype == jnp.float8_e5m2,
                                                            bool(fast_accum), ma != MODE_TENSOR, False))
            call = jax.ffi.ffi_call(FP8_CUTLASS_GROUPED, (jax.ShapeDtypeStruct((t, n), out_dtype),
                                                          jax.ShapeDtypeStruct((ws,), jnp.uint8)),
                                    input_output_aliases={5: 0} if aliases else {}, vmap_method="sequential")
            return call(operands[0], _fp8_scales(a), *operands[2:5], c, mode_a=np.int32(ma),
                        mode_b=np.int32(mb), accumulate=np.int32(accumulate is not None),
                        fast_accum=np.int32(fast_accum))[0]
        if _fp8_grouped_wgmma(n, k, g, kernel, name):
            call = jax.ffi.ffi_call(FP8_WGMMA_GROUPED, jax.ShapeDtypeStruct((t, n), out_dtype),
                                    input_output_aliases=aliases, vmap_method="sequential")
            return call(*operands, mode_a=np.int32(ma), mode_b=np.int32(mb),
                        accumulate=np.int32(accumulate is not None))
        call = jax.ffi.ffi_call(FP8_TARGET + "_grouped", jax.ShapeDtypeStruct((t, n), out_dtype),
                                input_output_aliases=aliases, vmap_method="sequential")
        return call(*operands, mode_a=np.int32(ma), mode_b=np.int32(mb), layout=np.int32(_layout()[0]),
                    pad=np.int32(_layout()[1]), accumulate=np.int32(accumulate is not None),
                    fast_accum=np.int32(fast_accum))
    fa, fb = _dq_fmt(a, name), _dq_fmt(b0, name)
    (_, k), (n, kb) = a.shape, b0.shape
    if k != kb or (fa == FMT_NVFP4) != (fb == FMT_NVFP4):
        raise GemmUnsupported(f"{name}: no kernel for {a.format} {a.shape} x {b0.format} {b0.shape}")
    if a.transposed or b0.transposed:
        raise GemmUnsupported(f"{name}: transposed copies are read by the dense GEMM only")
    kernel = _kernel_for_decoded(a, b0, kernel, name)
    if fa == FMT_NVFP4:
        if a.quantizer.uses_rht(a.axis) != b0.quantizer.uses_rht(b0.axis) or k % 16:
            raise GemmUnsupported(f"{name}: NVFP4 needs K % 16 == 0 and the same Hadamard use on both sides")
        amax_a = jnp.asarray(a.amax, jnp.float32)
        amax_b = jnp.asarray(stacked.amax, jnp.float32).reshape(g)
    else:
        if k % 8:
            raise GemmUnsupported(f"{name}: MXFP8 needs K % 8 == 0, got {k}")
        amax_a = amax_b = _empty(jnp.float32)
    if _use_wgmma(fa, fb, n, k, kernel, name, groups=g):
        out_dtype, bias_, c, aliases = _grouped_tail(t, g, n, out_dtype, bias, accumulate, name, 6)
        if not _registered():
            raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
        call = jax.ffi.ffi_call(MX_TARGET + "_grouped", jax.ShapeDtypeStruct((t, n), out_dtype),
                                input_output_aliases=aliases, vmap_method="sequential")
        return call(_u8(a.data), _u8(a.scale_inv), _u8(stacked.data), _u8(stacked.scale_inv), sizes, bias_, c,
                    fmt_a=np.int32(fa), fmt_b=np.int32(fb), k=np.int64(k), accumulate=np.int32(accumulate is not None))
    out_dtype, bias_, c, aliases = _grouped_tail(t, g, n, out_dtype, bias, accumulate, name, 8)
    if not _registered():
        raise GemmUnsupported(f"{name}: the GEMM kernels are not built")
    call = jax.ffi.ffi_call(DQ_TARGET + "_grouped", jax.ShapeDtypeStruct((t, n), out_dtype),
                            input_output_aliases=aliases,
                            vmap_method="sequential")
    return call(_dq_data(a), _dq_scales(a), amax_a, _dq_data(stacked), _dq_scales(stacked), amax_b, sizes,
                bias_, c, fmt_a=np.int32(fa), fmt_b=np.int32(fb), k=np.int64(k),
                accumulate=np.int32(accumulate is not None), rows_inner=np.int32(fa != FMT_NVFP4))


def _bf16_grouped(a: Storage, stacked: Storage, sizes, out_dtype, bias, accumulate, name):
    """Two high-precision (Identity) bf16 operands: CUTLASS's bf16 grouped kernel, the sizes on the device."""
    (t, k), (g, n, kb) = a.data.shape, stacked.data.shape
    dts = {jnp.dtype(a.data.dtype), jnp.dtype(stacked.data.dtype), jnp.dtype(out_dtype)}
    why = _cutlass_missing(BF16_CUTLASS_GROUPED) or (
           f"operands and output in {sorted(d.name for d in dts)} (bf16 only)" if dts != {jnp.dtype(jnp.bfloat16)}
           else "a bias" if bias is not None
           else f"K differs: A {a.data.shape}, B {stacked.data.shape}" if k != kb
           else f"K = {k} is not a multiple of 16" if k % 16 else f"N = {n} is not a multiple of 8" if n % 8
           else f"{g} groups (at most 1024)" if g > 1024 else "")
    if why:
        raise GemmUnsupported(f"{name}: high-precision operands: {why}")
    out_dtype, _, c, aliases = _grouped_tail(t, g, n, out_dtype, None, accumulate, name, 3)
    from . import load
    ws = int(load().cutlass_grouped_workspace_bytes(g, t, n, k, False, False, False, True))
    call = jax.ffi.ffi_call(BF16_CUTLASS_GROUPED, (jax.ShapeDtypeStruct((t, n), out_dtype), _workspace(ws)),
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(a.data, stacked.data, sizes, c, accumulate=np.int32(accumulate is not None))[0]


def segment_gemm(a: Storage, b: Storage, segment_sizes, out_dtype=jnp.bfloat16):
    """out[g] = A[:, seg g] @ B[:, seg g].T: a GEMM grouped along K, for A [M, K] and B [N, K] whose K axis is cut
    into consecutive segments, segment g segment_sizes[g] rounded up to a multiple of 128 long (clamped to K),
    read on the device; [G, M, N], zeros for an empty segment. The wgrad of the grouped MoE dispatch: A and B
    are the columnwise copies of the sorted inputs and gradients, each group's rows padded to whole 128-row
    blocks, and K their tokens. FP8 with 1x128 blocks along K on both operands (E4M3), or bf16 values on both
    (decoded MXFP8 copies, as the dequantize path reads them, or high-precision ones): a bf16 GEMM; K % 128 == 0,
    N % 8 == 0, bf16 out, on a Hopper with CUTLASS's kernels (fp8_cutlass_grouped.h); GemmUnsupported otherwise."""
    name = "segment GEMM"
    (m, k), (n, kb) = a.shape, b.shape
    block = [s.quantizer.name == "fp8_block" and _fp8_mode(s, name) == MODE_VEC128 and not s.transposed
             and s.data.dtype == jnp.float8_e4m3fn for s in (a, b)]
    decoded = [(s.quantizer.name == "mxfp8" and s.decoded or s.quantizer.name == "identity") and not s.transposed
               and s.data.dtype == jnp.bfloat16 for s in (a, b)]
    why = _cutlass_missing(CUTLASS_KGROUPED) or (
           f"{a.format} x {b.format} (E4M3 with 1x128 blocks, or bf16 values, on both operands only)"
           if not (all(block) or all(decoded))
           else f"K differs: A {a.shape}, B {b.shape}" if k != kb
           else f"K = {k} is not a multiple of 128" if k % 128 else f"N = {n} is not a multiple of 8" if n % 8
           else f"{jnp.dtype(out_dtype).name} output (bf16 only)" if jnp.dtype(out_dtype) != jnp.bfloat16
           else "")
    if why:
        raise GemmUnsupported(f"{name}: {why}")
    sizes = jnp.asarray(segment_sizes, jnp.int32).reshape(-1)
    g = sizes.shape[0]
    if g > 1024:
        raise GemmUnsupported(f"{name}: {g} groups (at most 1024)")
    from . import load
    bf16 = all(decoded)
    ws = int(load().cutlass_kgrouped_workspace_bytes(g, m, n, k, bf16))
    call = jax.ffi.ffi_call(CUTLASS_KGROUPED, (jax.ShapeDtypeStruct((g, m, n), jnp.bfloat16), _workspace(ws)),
                            vmap_method="sequential")
    scales = (_empty(jnp.float32),) * 2 if bf16 else (_fp8_scales(a), _fp8_scales(b))
    return call(a.data, scales[0], b.data, scales[1], sizes)[0]


def stack_storages(bs, name: str = "stack_storages") -> Storage:
    """G storages of one format and shape -> one Storage whose arrays have a leading group axis: the stacked
    form grouped_gemm takes (stack the weights once, not on every call)."""
    bs = list(bs)
    if not bs:
        raise GemmUnsupported(f"{name}: no groups")
    kinds = {(s.format, s.axis, s.shape, s.data.shape, s.data.dtype) for s in bs}
    if len(kinds) != 1:
        raise GemmUnsupported(f"{name}: the groups' weights differ in format or shape ({sorted(map(str, kinds))})")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *bs)


def _grouped_tail(t, g, n, out_dtype, bias, accumulate, name, c_index):
    out_dtype, _, c, aliases = _out_tail(t, n, out_dtype, None, accumulate, name)
    b = _empty(out_dtype) if bias is None else jnp.asarray(bias, out_dtype).reshape(g, n)
    return out_dtype, b, c, ({c_index: 0} if aliases else {})
