"""From a quantizer to the FFI kernels: `quantize_copies` makes the requested copies of a 2D tensor in one
kernel launch (plus an amax pass for per-tensor formats) and returns the same Storage pytrees as the
reference `Quantizer.quantize_2d`, or None when this platform or format has no kernel (callers then run
the reference). Sides the kernels do not cover (Identity) are made by the reference.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..formats import fp8 as _fp8
from ..formats import nvfp4 as _nv
from ..formats.base import COLUMNWISE, ROWWISE, USAGES, Storage, abs_max_f32, canonical_nan
from ..formats.fp8 import Float8CurrentScaling, Float8DelayedScaling
from ..formats.fp8_block import Float8Block
from ..formats.hybrid import Hybrid, side
from ..formats.mxfp8 import MXFP8
from ..formats.nvfp4 import NVFP4
from ..formats.quantize import quantize_paths
from . import load
from . import partitioning as PT
from . import primitives as P


def format_id(q, axis: str) -> Optional[tuple]:
    """(format id, option bits) of a plain quantizer for the `axis` copy, or None when no kernel covers it."""
    e5 = P.OPT_E5M2 if getattr(q, "fmt", "e4m3") == "e5m2" else 0
    if isinstance(q, Float8CurrentScaling):  # the kernel computes the scale from the amax it is given
        return P.FP8_TENSOR, e5 | P.OPT_FROM_AMAX | (P.OPT_POW2 if q.power_2_scale else 0)
    if isinstance(q, Float8DelayedScaling):
        return P.FP8_TENSOR, e5
    if isinstance(q, MXFP8):
        return P.MXFP8, e5
    if isinstance(q, NVFP4):  # the kernel computes the global encode from the amax it is given
        opts = ((P.OPT_BLOCK2D if q.block_2d else 0) | (P.OPT_RHT if q.uses_rht(axis) else 0)
                | (P.OPT_SR if q.stochastic_rounding else 0))
        return P.NVFP4, opts | P.OPT_FROM_AMAX
    if isinstance(q, Float8Block):
        fid = P.FP8_BLOCK_1x128 if q.block == (1, 128) else P.FP8_BLOCK_128x128
        return fid, (P.OPT_POW2 if q.power_2_scale else 0)
    return None


def _side_state(q, state, axis):
    if isinstance(q, Hybrid):
        return None if state is None else state.get(axis)
    return state


def quantize_copies(x2d, quantizer, usage=USAGES, *, key=None, state=None, amax=None,
                    platform: Optional[str] = None, poison: bool = False, sides=None,
                    transposed: bool = False, cast_to=None, decoded=(), act_grad=None) -> Optional[dict]:
    """{axis: Storage} for each axis in `usage` (rowwise [M, K], columnwise [K, M]) of x2d [M, K], bit-equal
    to `side(quantizer, axis).quantize_2d`, or None when the kernels do not apply here.

    transposed: x2d is given as its transpose [K, M]; the kernel reads it where it lies and writes each copy
    from the other side (the rowwise copy of x2d is the columnwise copy of what it reads), so no transposed
    copy of x2d is made first. Stochastic rounding then draws other numbers (each copy's stream is its side
    of the launch); the Hadamard-transformed amax is not taken this way, so with an RHT side x2d is transposed
    first and launched as usual.
    cast_to: the copies are those of x2d.astype(cast_to). From float32 to bfloat16 the kernel rounds as it reads
    (OPT_BF16_INPUT: no bf16 copy of x2d is written). Other casts, and launches that need a per-tensor amax
    first (FP8 current scaling, NVFP4), cast in XLA: there the cast fusion takes the amax in the same pass, which
    measured faster than an amax pass over the float32 x (docs/ffi.md).

    quantizer: a plain quantizer or a Hybrid (normalized); key: jax.random key (stochastic rounding);
    state: delayed-scaling state (per side for a Hybrid, as jaxhq.formats.init_state makes it);
    amax: a precomputed per-tensor amax used by the per-tensor sides.
    platform: "cpu" or "cuda" (default: where x2d lives); poison: tests only, see primitives.quantize.
    sides: the axes the kernel makes (default: every one it covers); the others are made by the reference.
    decoded: the axes whose MXFP8 / NVFP4 copy is written as its values (bf16, `Storage.decoded`) instead of its
    codes, for a GEMM that would dequantize it first (the Hopper path of jaxhq.ffi.gemm.blockscaled_gemm).
    act_grad: (dy, act): the copies are of an activation's input gradient, x2d being the activation's input h
    (P.quantize's `act`): made in one launch from h and dy where the kernels take them (no per-tensor amax needed
    first, every side a kernel format; on the GPU one FP8 per-tensor, MXFP8 or blockwise format on both sides,
    act_grad_on_gpu), else None.
    """
    if load() is None or x2d.ndim != 2:
        return None
    platform = platform or P.platform_of(x2d)
    if not P.has_kernel(platform):
        return None
    bf16_in = cast_to is not None and x2d.dtype == jnp.float32 and jnp.dtype(cast_to) == jnp.bfloat16
    if cast_to is not None and not bf16_in and jnp.dtype(cast_to) != x2d.dtype:
        x2d = x2d.astype(cast_to)
    m, k = x2d.shape[::-1] if transposed else x2d.shape
    ids = {a: format_id(side(quantizer, a), a) if sides is None or a in sides else None for a in usage}
    if all(v is None for v in ids.values()):
        return None
    ids.update({a: (v[0], v[1] | P.OPT_DECODED) for a, v in ids.items()
                if a in decoded and v is not None and v[0] in (P.MXFP8, P.NVFP4)})
    for a in usage:
        side(quantizer, a).check_shape(*((m, k) if a == ROWWISE else (k, m)), a)
    if act_grad is not None and (transposed or cast_to is not None or any(v is None for v in ids.values()) or
                                 x2d.dtype != jnp.bfloat16 or act_grad[0].dtype != jnp.bfloat16 or
                                 (platform == "cuda" and not act_grad_on_gpu(ids))):
        return None

    # Per-tensor amaxes. FP8 current scaling and NVFP4 need theirs before quantizing (the RHT side the
    # transformed one); delayed scaling's scale is known beforehand, so its amax (for the history) comes out of
    # the quantize kernel itself, from the values it reads anyway: no pass of its own.
    delayed = {a for a, v in ids.items() if v is not None and isinstance(side(quantizer, a), Float8DelayedScaling)}
    need_amax = _needs_amax(quantizer, ids)
    need_rht = any(v is not None and v[0] == P.NVFP4 and v[1] & P.OPT_RHT for v in ids.values())
    if act_grad is not None and need_amax and amax is None:  # the amax kernels read x itself
        return None
    if bf16_in and amax is None and need_amax:  # XLA's cast carries the amax pass (its fusion or the amax kernel)
        x2d, bf16_in = x2d.astype(jnp.bfloat16), False
    if need_rht and transposed:  # the amax kernel transforms columns of what it reads: give it the tensor
        return quantize_copies(x2d.T, quantizer, usage, key=key, state=state, amax=amax, platform=platform,
                               poison=poison, sides=sides, decoded=decoded)
    x_ref = x2d.astype(jnp.bfloat16) if bf16_in else x2d  # what the copies are of (the reference sides, the amax)
    # On the "xla" amax path the amax is a jnp reduction that XLA fuses into the op producing x (x is not read
    # again). The kernel computes the scale from a NaN amax whatever its bits, so it takes the reduction's own
    # result (`raw`, no small kernel after the reduction); the Storage records the canonical NaN.
    amax_plain = amax_rht = raw = None
    if amax is not None:
        amax_plain = amax_rht = jnp.asarray(amax, jnp.float32)
    elif need_amax and not need_rht and quantize_paths()["amax"] == "xla":
        raw = abs_max_f32(x_ref)
        amax_plain = canonical_nan(raw)
    elif need_amax:
        amax_plain, amax_rht = PT.amax(x2d, rht=need_rht)

    # Each copy's scalar: the amax (current scaling and NVFP4: the kernel computes the scale and scale_inv, or the
    # global encode, from it, so no small XLA kernels surround the launch) or the state's scale (delayed).
    values, amaxes, key_words, eps = {}, {}, jnp.zeros((2,), jnp.uint32), None
    for a in USAGES:
        v = ids.get(a)
        q = side(quantizer, a)
        s = None
        if v is not None and v[0] == P.FP8_TENSOR:
            amaxes[a] = amax_plain
            if isinstance(q, Float8DelayedScaling):
                st = _side_state(quantizer, state, a)
                if st is None:
                    return None  # the reference raises the helpful error
                s = st["scale"]
            elif eps is None or eps == q.amax_epsilon:  # one eps per launch
                eps, s = q.amax_epsilon, amax_plain if raw is None else raw
            else:
                s = _fp8.scale_from_amax(amax_plain, q.fmt, q.amax_epsilon, q.power_2_scale)
                ids[a] = (P.FP8_TENSOR, v[1] & ~(P.OPT_FROM_AMAX | P.OPT_POW2))
        elif v is not None and v[0] == P.NVFP4:
            am = amax_rht if v[1] & P.OPT_RHT else amax_plain
            amaxes[a] = am
            s = am if raw is None or v[1] & P.OPT_RHT else raw
            if v[1] & P.OPT_SR:
                if key is None:
                    return None  # the reference raises the helpful error
                key_words = P.key_words(key)
        if s is not None:
            values[a] = s
    # The launch's sides: its rowwise copy is made along the rows of what it reads (x2d's columnwise copy when
    # that is the transpose).
    launch = (COLUMNWISE, ROWWISE) if transposed else USAGES
    # each copy's scalar as an operand of its own (no kernel stacks them); a copy that reads none takes the other's
    vals = list(values.values()) or [1.0]
    scales = tuple(values.get(a, vals[0]) for a in launch)
    seed = P.seed_words(key_words, *x2d.shape)
    no = (P.NONE, 0)
    row, col = ids.get(launch[0]) or no, ids.get(launch[1]) or no
    if bf16_in:  # both copies of the launch read x2d as bf16
        row, col = ((f, o | P.OPT_BF16_INPUT) if f != P.NONE else (f, o) for f, o in (row, col))
    want_amax = bool(delayed) and amax_plain is None
    dy, act = act_grad if act_grad is not None else (None, 0)
    eps = eps or 0.0
    if poison:  # tests: the unpartitioned call that writes into poisoned buffers
        rd, rs, cd, cs, kamax = P.quantize(x2d, scales, seed, row, col, poison=True, want_amax=want_amax,
                                           amax_eps=eps, dy=dy, act=act)
    else:  # sharding-aware: each shard quantized where it lives
        outs = iter(PT.quantize(x2d, scales, seed, row, col, want_amax=want_amax, amax_eps=eps, dy=dy, act=act))
        rd, rs = (next(outs), next(outs)) if row[0] else (None, None)
        cd, cs = (next(outs), next(outs)) if col[0] else (None, None)
        kamax = next(outs) if want_amax else None
    if want_amax:
        amaxes.update({a: canonical_nan(kamax) for a in delayed})
    made = {launch[0]: (rd, rs), launch[1]: (cd, cs)}

    out = {}
    for a, shape in ((ROWWISE, (m, k)), (COLUMNWISE, (k, m))):
        if a not in usage:
            continue
        q = side(quantizer, a)
        v = ids[a]
        data, sc = made[a]
        if v is None:  # e.g. Identity: the reference makes this side
            arr = x_ref if (a == ROWWISE) != transposed else x_ref.T
            sk = None if key is None else jax.random.fold_in(key, USAGES.index(a))
            out[a] = q.quantize_2d(arr, a, key=sk, state=_side_state(quantizer, state, a), amax=amax)
            continue
        out[a] = Storage(data=data, scale_inv=sc, amax=amaxes.get(a), quantizer=q, axis=a, shape=shape,
                         decoded=bool(v[1] & P.OPT_DECODED))
    return out


def _needs_amax(quantizer, ids: dict) -> bool:
    """Whether a side reads a per-tensor amax before quantizing: FP8 current scaling and NVFP4 (delayed scaling
    knows its scale beforehand)."""
    return any(v is not None and v[0] in (P.FP8_TENSOR, P.NVFP4) and
               not isinstance(side(quantizer, a), Float8DelayedScaling) for a, v in ids.items())


def takes_act_grad(quantizer, usage=USAGES, platform: str = "cuda") -> bool:
    """Whether quantize_copies makes these copies of an activation's gradient in one launch from bf16 h and dy
    (no per-tensor amax given): every side a kernel format that needs no amax first, and on the GPU
    act_grad_on_gpu."""
    ids = {a: format_id(side(quantizer, a), a) for a in usage}
    if any(v is None for v in ids.values()) or _needs_amax(quantizer, ids):
        return False
    return platform != "cuda" or act_grad_on_gpu(ids)


def act_grad_on_gpu(ids: dict) -> bool:
    """Whether the GPU kernel makes these copies of an activation's gradient: both copies, in one FP8 per-tensor,
    MXFP8 or FP8 blockwise format (the register-tile kernel's formats)."""
    fmts = {ids.get(a, (P.NONE, 0))[0] for a in USAGES}
    return len(fmts) == 1 and fmts <= {P.FP8_TENSOR, P.MXFP8, P.FP8_BLOCK_1x128, P.FP8_BLOCK_128x128}


def rows_inner_scales(s: Storage) -> bool:
    """Whether the quantize launch writes this copy's scales rows-inner (1x128, MXFP8: P.ROWS_INNER_SCALES)."""
    return s.scale_inv is not None and (format_id(s.quantizer, s.axis) or (None,))[0] in P.ROWS_INNER_SCALES


def launch_scales(s: Storage):
    """s.scale_inv in the layout the quantize launch wrote it: [..., blocks, rows] for rows_inner_scales copies
    (P.swap_rows_inner, undoing the wrapper's swap: under jit XLA cancels the pair, so a GEMM or a collective that
    takes this reads the launch's buffer with no transpose), as stored otherwise."""
    return P.swap_rows_inner(s.scale_inv) if rows_inner_scales(s) else s.scale_inv


def dequantize_storage(s: Storage, platform: Optional[str] = None):
    """float32 values of one copy through the dequantize kernel (RHT undone by the reference transform),
    or None when there is no kernel for it here."""
    if load() is None or s.decoded:
        return None
    platform = platform or P.platform_of(s.data)
    v = format_id(s.quantizer, s.axis)
    if v is None or not P.has_kernel(platform, "jaxhq_dequantize"):
        return None
    fid, opts = v
    if fid == P.FP8_TENSOR:
        scalar = s.scale_inv
    elif fid == P.NVFP4:
        scalar = _nv.global_encode(s.amax)
    else:
        scalar = jnp.float32(0)
    block_scales = None if fid == P.FP8_TENSOR else s.scale_inv
    y = P.dequantize(s.data, block_scales, scalar, fid, opts, s.shape)
    if fid == P.NVFP4 and opts & P.OPT_RHT:
        y = _nv.apply_rht(y, inverse=True)
    return y
