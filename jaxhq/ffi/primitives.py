"""The FFI calls as JAX functions: abstract shapes, batching (vmap over leading axes) and platform choice.

Targets (one handler each on "cpu" and "CUDA"):
  jaxhq_amax(x[..., M, K]) -> (amax[...], amax_rht[...])          per-tensor max |x| (and of RHT(x.T) when rht)
  jaxhq_quantize(x[..., M, K], dy, scale_row[..., 1], scale_col[..., 1], seed[..., 6])
      -> (row_data, row_scale, col_data, col_scale, amax)          any rowwise format with any columnwise
                                                                    format, one read of x; amax [...] (or
                                                                    empty, not asked for) is max |x| of
                                                                    that same read; OPT_BF16_INPUT on both
                                                                    copies: float32 x read as x.astype(bf16)
      with act: x is an activation's input and dy its output's gradient; the copies are of its input's gradient
  jaxhq_dequantize(data, scale, scalar[...]) -> float32[..., R, C]
  jaxhq_act_grad(h[..., M, K], dy[..., M, K or K / 2]) -> bfloat16[..., M, K]   an activation's input gradient
Formats and option bits are the enums of csrc/numerics.h (FORMAT_IDS, OPT_* here).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import registered_targets

NONE, FP8_TENSOR, MXFP8, NVFP4, FP8_BLOCK_1x128, FP8_BLOCK_128x128 = range(6)
OPT_E5M2, OPT_POW2, OPT_BLOCK2D, OPT_RHT, OPT_SR, OPT_FROM_AMAX, OPT_BF16_INPUT, OPT_DECODED = 1, 2, 4, 8, 16, 32, 64, 128
ACT_GELU, ACT_SILU, ACT_RELU, GATED = 1, 2, 3, 16  # activation ids of csrc/activation.h (quantize's `act`)
_EMPTY = jax.ShapeDtypeStruct((0,), jnp.uint8)


def data_shape_dtype(fmt: int, opts: int, rows: int, cols: int, batch=()):
    """Shape and dtype of a copy's data for format id `fmt` (OPT_DECODED: its bfloat16 values)."""
    if fmt == NONE:
        return None
    if opts & OPT_DECODED:
        return jax.ShapeDtypeStruct((*batch, rows, cols), jnp.bfloat16)
    if fmt == NVFP4:
        return jax.ShapeDtypeStruct((*batch, rows, (cols + 1) // 2), jnp.uint8)
    dt = jnp.float8_e5m2 if opts & OPT_E5M2 else jnp.float8_e4m3fn
    return jax.ShapeDtypeStruct((*batch, rows, cols), dt)


def scale_shape_dtype(fmt: int, rows: int, cols: int, batch=()):
    """Shape and dtype of a copy's scale output: per-block scales, or a per-tensor copy's scale_inv."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if fmt == FP8_TENSOR:
        return jax.ShapeDtypeStruct(tuple(batch), jnp.float32)
    if fmt == MXFP8:
        return jax.ShapeDtypeStruct((*batch, rows, cdiv(cols, 32)), jnp.float8_e8m0fnu)
    if fmt == NVFP4:
        return jax.ShapeDtypeStruct((*batch, rows, cdiv(cols, 16)), jnp.float8_e4m3fn)
    if fmt == FP8_BLOCK_1x128:
        return jax.ShapeDtypeStruct((*batch, rows, cdiv(cols, 128)), jnp.float32)
    if fmt == FP8_BLOCK_128x128:
        return jax.ShapeDtypeStruct((*batch, cdiv(rows, 128), cdiv(cols, 128)), jnp.float32)
    return None


# The block formats whose scales the quantize launch writes rows-inner (csrc/spec.h rows_inner_scale_index).
ROWS_INNER_SCALES = (MXFP8, FP8_BLOCK_1x128)


def launch_scale_shape_dtype(fmt: int, rows: int, cols: int, batch=()):
    """A copy's scale output as the quantize launch writes it: scale_shape_dtype's, except 1x128 and MXFP8 scales,
    which come [..., blocks, rows] (csrc/spec.h rows_inner_scale_index: a CTA's rows side by side; for 1x128 the
    layout the FP8 GEMM hands cuBLASLt as it is; swap_rows_inner turns one layout into the other)."""
    sds = scale_shape_dtype(fmt, rows, cols, batch)
    if fmt not in ROWS_INNER_SCALES:
        return sds
    return jax.ShapeDtypeStruct((*sds.shape[:-2], sds.shape[-1], sds.shape[-2]), sds.dtype)


def swap_rows_inner(scales):
    """1x128 or MXFP8 scales between the Storage's [..., rows, blocks] and the quantize launch's [..., blocks, rows]
    (its own inverse). `quantize` applies it to the launch's output and the GEMMs that read the launch's layout
    apply it again, so under jit XLA cancels the pair and the GEMM reads the launch's buffer itself; a consumer
    that reads the Storage's layout gets XLA's transpose."""
    return jnp.swapaxes(scales, -1, -2)


def platform_of(x) -> str:
    """"cpu" or "cuda": where an op on x would run (its committed device, else the default backend)."""
    try:
        devs = x.devices() if hasattr(x, "devices") and not isinstance(x, jax.core.Tracer) else None
    except Exception:
        devs = None
    p = next(iter(devs)).platform if devs else jax.default_backend()
    return "cuda" if p in ("gpu", "cuda") else p


def has_kernel(platform: str, target: str = "jaxhq_quantize") -> bool:
    return target in registered_targets().get(platform, [])


def amax(x, rht: bool = False):
    """(max |x|, max |RHT(x.T)|) as float32 scalars per leading batch index; the second is 0 without rht."""
    registered_targets()
    batch = x.shape[:-2]
    out = jax.ShapeDtypeStruct(batch, jnp.float32)
    call = jax.ffi.ffi_call("jaxhq_amax", (out, out), vmap_method="broadcast_all")
    return call(x, rht=np.int32(bool(rht)))


def poison_like(sds):
    """An array of sds's shape and dtype with every byte 0xFF (NaN for floats): unwritten outputs show."""
    dt = jnp.dtype(sds.dtype)
    ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize]
    raw = jnp.full(sds.shape, (1 << (8 * dt.itemsize)) - 1, ut)
    return raw if dt == ut else jax.lax.bitcast_convert_type(raw, dt)


def key_words(key):
    """The two uint32 words of a jax.random key that the kernels' stochastic rounding hashes (csrc/numerics.h
    sr_key mixes each fully): the key's own data, so a launch costs no random-bits kernel; a key of more words
    (another PRNG implementation) is folded to two by xor."""
    data = jax.random.key_data(key).astype(jnp.uint32).reshape(-1, 2)
    words = data[0]
    for row in range(1, data.shape[0]):
        words = words ^ data[row]
    return words


def seed_words(key_words, m: int, k: int, m0=0, k0=0):
    """The quantize seed of an [m, k] tensor: key (2 uint32), offset (m0, k0) of this piece in it, its shape."""
    u = lambda v: jnp.asarray(v, jnp.uint32).reshape(1)  # noqa: E731
    return jnp.concatenate([jnp.asarray(key_words, jnp.uint32).reshape(2), u(m0), u(k0), u(m), u(k)])


def scale_operands(scales, x_shape):
    """The launch's (scale_row, scale_col) operands, [..., 1] float32 each, from a copy's scalar pair for x of
    x_shape [..., M, K]: one value per batch element, or a clear error naming the shapes."""
    batch = tuple(x_shape[:-2])
    s_row, s_col = (jnp.asarray(s, jnp.float32) for s in scales)
    if any(math.prod(s.shape) != math.prod(batch) for s in (s_row, s_col)):
        raise ValueError(f"jaxhq quantize: each copy's scalar holds one value per batch element of x {tuple(x_shape)} "
                         f"(batch {batch}), got scalars of shapes {s_row.shape} and {s_col.shape}")
    return s_row.reshape((*batch, 1)), s_col.reshape((*batch, 1))


def quantize(x, scales, seed, row=(NONE, 0), col=(NONE, 0), poison: bool = False, want_amax: bool = False,
             amax_eps: float = 0.0, dy=None, act: int = 0):
    """Both copies of x [..., M, K] in one read: (row_data, row_scale, col_data, col_scale, amax).

    scales: (rowwise, columnwise), each float32 [...] (one value per batch element; the same array may serve
    both): the per-tensor scale (FP8; with OPT_FROM_AMAX the amax, from which the kernel computes the scale as
    fp8.scale_from_amax with `amax_eps`) or the global encode scale (NVFP4; with OPT_FROM_AMAX the amax, from
    which the kernel computes nvfp4.global_encode) of each copy. Two operands rather than one stacked array, so
    two scalars made apart (NVFP4's plain and Hadamard-transformed amaxes) reach the launch without a kernel
    that stacks them. A per-tensor copy's scale output is its scale_inv [...] float32; 1x128 and MXFP8 scales
    come [..., rows, blocks] like every block format's (the launch writes them transposed:
    launch_scale_shape_dtype).
    seed [..., 6] uint32: stochastic-rounding key (2 words), then this shard's offset in the global x (row,
    column) and the global (M, K), see `seed_words`. Absent outputs are None.
    poison: write into outputs first filled with 0xFF bytes (tests: proves every element is written).
    want_amax: also max |x| per batch element (float32 [...]) from the values the copies read, so a format
    whose scale is known beforehand (delayed scaling) needs no separate amax pass. It is NaN when any element
    is NaN, with an unspecified NaN pattern (`formats.base.canonical_nan` makes it abs_max's).
    act (with dy): the copies are of an activation's gradient instead of x's: x is the activation's input h and dy
    the gradient of its output, both bfloat16 (dy [..., M, K], gated: [..., M, K / 2]); act is an id of
    ACT_* here (| GATED). Each element is the gradient rounded to bfloat16 (csrc/activation.h),
    quantized as x would be; it is never written.
    """
    registered_targets()
    *batch, m, k = x.shape
    batch = tuple(batch)
    (rf, ro), (cf, co) = row, col
    outs = (data_shape_dtype(rf, ro, m, k, batch), launch_scale_shape_dtype(rf, m, k, batch),
            data_shape_dtype(cf, co, k, m, batch), launch_scale_shape_dtype(cf, k, m, batch))
    outs = tuple(_EMPTY if o is None else o for o in outs)
    outs += (jax.ShapeDtypeStruct(batch, jnp.float32) if want_amax else _EMPTY,)
    attrs = dict(row_fmt=np.int32(rf), row_opts=np.int32(ro), col_fmt=np.int32(cf), col_opts=np.int32(co),
                 amax_eps=np.float32(amax_eps), act=np.int32(act))
    dy = jnp.zeros((0,), jnp.bfloat16) if dy is None else dy
    args = (x, dy, *scale_operands(scales, x.shape), seed.astype(jnp.uint32))
    if poison:
        call = jax.ffi.ffi_call("jaxhq_quantize_into", outs, vmap_method="broadcast_all",
                                input_output_aliases={5: 0, 6: 1, 7: 2, 8: 3})
        res = call(*args, *(poison_like(o) for o in outs[:4]), **attrs)
    else:
        res = jax.ffi.ffi_call("jaxhq_quantize", outs, vmap_method="broadcast_all")(*args, **attrs)
    res = [None if o is _EMPTY else r for o, r in zip(outs, res)]
    for i, fmt in ((1, rf), (3, cf)):
        if fmt in ROWS_INNER_SCALES:
            res[i] = swap_rows_inner(res[i])
    return tuple(res)


def act_grad(h, dy, act: int):
    """The gradient of activation `act` (ACT_* | GATED) at h given its output's gradient dy, bfloat16 of h's
    shape: what quantize(h, ..., dy=dy, act=act) makes its copies of (csrc/activation.h)."""
    registered_targets()
    out = jax.ShapeDtypeStruct(h.shape, jnp.bfloat16)
    return jax.ffi.ffi_call("jaxhq_act_grad", out, vmap_method="broadcast_all")(h, dy, act=np.int32(act))


def dequantize(data, scale, scalar, fmt: int, opts: int, shape):
    """float32 [..., R, C] of one copy; `scalar` is scale_inv (FP8 per-tensor) or global encode (NVFP4)."""
    registered_targets()
    *batch, r, c = shape
    if scale is None:
        scale = jnp.zeros((0,), jnp.uint8)
    out = jax.ShapeDtypeStruct((*batch, r, c), jnp.float32)
    call = jax.ffi.ffi_call("jaxhq_dequantize", out, vmap_method="broadcast_all")
    return call(data, scale, jnp.asarray(scalar, jnp.float32).reshape(tuple(batch)), fmt=np.int32(fmt),
                opts=np.int32(opts))


def nbytes(sds) -> int:
    return 0 if sds is None else math.prod(sds.shape) * jnp.dtype(sds.dtype).itemsize
