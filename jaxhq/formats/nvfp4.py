"""NVFP4: E2M1 elements two per byte, an E4M3 scale per 1x16 block (or 16x16 tile) and one fp32 global scale.

global_encode = 448 * 6 / amax_tensor (1 when amax is 0, at most MAX_GLOBAL_ENCODE = 2^118); per block,
decode = e4m3(min(amax_block * (global_encode * (1/6)), 448)); elements are e2m1_rne(x * (global_encode / decode)),
saturating at +-6, packed two per byte with the even element in the low nibble. A block whose decode scale is 0
stores zeros. Dequantized value = e2m1 * (decode / global_encode).

Options: `block_2d` uses 16x16 tiles (for weights: the columnwise copy is then the exact transpose of the
rowwise one); the tile's scale is stored on each of its 16 rows, so the scale layout [rows, ceil(cols/16)]
is the same as for 1x16. `rht` applies a 16-point random Hadamard transform (fixed signs, orthonormal) along
the columnwise copy's blocks before quantizing; used on both wgrad operands it cancels in the GEMM, and
`dequantize` undoes it. `stochastic_rounding` rounds elements stochastically from a jax.random key.
Shapes the block does not divide are zero-padded inside; the packed data keeps ceil(cols/2) bytes a row.
RHT needs the transformed axis to be a multiple of 16 (zero padding would not be invertible).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .base import (COLUMNWISE, ROWWISE, QuantizationError, Quantizer, Storage, abs_max, block_amax, expand_blocks,
                   pad_to)
from .casts import (E2M1_MAX, e2m1_codes, e2m1_codes_stochastic, e2m1_decode, pack_nibbles, saturating_fp8,
                    unpack_nibbles)

NV_BLOCK = 16
E4M3_MAX = 448.0
# Fixed sign vector of the random Hadamard transform (drawn once; part of the format).
RHT_SIGNS = np.array([1, -1, 1, 1, -1, -1, 1, -1, -1, 1, -1, 1, 1, 1, -1, -1], np.float32)


def hadamard16():
    h = np.array([[1.0]], np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return h


def rht_matrix():
    """Orthonormal 16x16 matrix T = H diag(signs) / 4 applied to each 16-block: v -> v @ T.T."""
    return (hadamard16() * RHT_SIGNS[None, :] / 4.0).astype(np.float32)


def _walsh_hadamard16(v):
    """v @ H over the last axis (16, Sylvester H) as 4 add/subtract stages: a fixed summation order that the
    kernels use too, so XLA cannot pick a different one per backend."""
    lead = v.shape[:-1]
    for h in (1, 2, 4, 8):
        pairs = v.reshape(*lead, NV_BLOCK // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, NV_BLOCK)
    return v


def apply_rht(x2d, inverse: bool = False):
    """Each 16-block v -> v @ T.T (forward: signs, Hadamard, x1/4) or v @ T (inverse: Hadamard, signs, x1/4)."""
    rows, cols = x2d.shape
    signs = jnp.asarray(RHT_SIGNS)
    blocks = x2d.astype(jnp.float32).reshape(rows, cols // NV_BLOCK, NV_BLOCK)
    if inverse:
        out = _walsh_hadamard16(blocks) * signs
    else:
        out = _walsh_hadamard16(blocks * signs)
    return (out * jnp.float32(0.25)).reshape(rows, cols)


# The largest global encode scale. A tensor whose amax is below 448 * 6 / FLT_MAX (about 7.9e-36) made
# 448 * 6 / amax overflow to inf, and a zero block then got the scale 0 * inf = NaN. Capped at 2^118, the block
# encode multiplier global_encode / decode stays finite down to the smallest E4M3 decode scale (2^-9), and the
# global decode factor 1 / global_encode is a normal float32.
MAX_GLOBAL_ENCODE = 2.0 ** 118


def global_encode(amax):
    # amax 0 -> 1; NaN -> NaN and Inf -> 0, so a non-finite input dequantizes to NaN everywhere.
    genc = jnp.where(amax == 0, jnp.float32(1.0), jnp.float32(E4M3_MAX * E2M1_MAX) / amax)
    return jnp.minimum(genc, jnp.float32(MAX_GLOBAL_ENCODE))


@dataclasses.dataclass(frozen=True)
class NVFP4(Quantizer):
    block_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    name = "nvfp4"
    block = NV_BLOCK

    @property
    def label(self) -> str:
        opts = [o for o, on in (("2d", self.block_2d), ("rht", self.rht), ("sr", self.stochastic_rounding)) if on]
        return "nvfp4" + ("_" + "_".join(opts) if opts else "")

    def uses_rht(self, axis: str) -> bool:
        return self.rht and axis == COLUMNWISE

    def check_shape(self, rows: int, cols: int, axis: str) -> None:
        if self.uses_rht(axis) and cols % NV_BLOCK:
            raise QuantizationError(
                f"{self.label}: the random Hadamard transform runs along an axis of {cols}, which must be a "
                f"multiple of {NV_BLOCK} (tensor copy [{rows}, {cols}], {axis})")

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        rows, cols = x2d.shape
        self.check_shape(rows, cols, axis)
        if self.stochastic_rounding and key is None:
            raise ValueError(f"{self.label} rounds stochastically and needs a jax.random key (key=...)")
        x = x2d.astype(jnp.float32)
        if self.uses_rht(axis):
            x = apply_rht(x)
        if amax is None:
            amax = abs_max(x)
        amax = amax.astype(jnp.float32)
        genc = global_encode(amax)

        xp = pad_to(x, NV_BLOCK if self.block_2d else 1, NV_BLOCK)
        prow, pcol = xp.shape
        amax_b = block_amax(xp, NV_BLOCK)  # [prow, pcol/16]
        if self.block_2d:
            tiles = abs_max(amax_b.reshape(prow // NV_BLOCK, NV_BLOCK, pcol // NV_BLOCK), axis=1)
            amax_b = jnp.repeat(tiles, NV_BLOCK, axis=0)
        # The barriers pin the rounding of the scale arithmetic: without them XLA rewrites these products and
        # divisions differently depending on the surrounding program, and eager, jit and kernels would differ.
        dscale = jax.lax.optimization_barrier(genc * jnp.float32(1.0 / E2M1_MAX))
        decode = saturating_fp8(amax_b * dscale, "e4m3")
        dec32 = jax.lax.optimization_barrier(decode.astype(jnp.float32))
        enc = jax.lax.optimization_barrier(jnp.where(dec32 == 0, jnp.float32(0.0), genc / dec32))
        y = jnp.clip(xp * expand_blocks(enc, NV_BLOCK, pcol), -E2M1_MAX, E2M1_MAX)
        codes = e2m1_codes_stochastic(y, key) if self.stochastic_rounding else e2m1_codes(y)
        codes = codes[:rows, :cols + (cols % 2)]  # an odd row ends with a zero (padding) nibble
        data = pack_nibbles(codes)
        return Storage(data=data, scale_inv=decode[:rows], amax=amax, quantizer=self, axis=axis, shape=(rows, cols))

    def dequantize_2d(self, s: Storage):
        x = self.dequantize_transformed(s)
        return apply_rht(x, inverse=True) if self.uses_rht(s.axis) else x

    def dequantize_transformed(self, s: Storage):
        """Values in the transformed (RHT) domain, as a GEMM whose both operands carry the RHT reads them."""
        rows, cols = s.shape
        block = s.scale_inv.astype(jnp.float32)
        if s.decoded:  # bf16 values e2m1 * block scale: the E2M1 values back (multiples of 0.5, so the rounding
            # undoes GPU division's last-bit error), 0 in a block scaled by 0
            b = expand_blocks(block, NV_BLOCK, cols)
            vals = jnp.round(2.0 * (s.data.astype(jnp.float32) / jnp.where(b == 0, 1.0, b))) * 0.5
        else:
            vals = e2m1_decode(unpack_nibbles(s.data))[:, :cols]
        return vals * expand_blocks(block / global_encode(s.amax), NV_BLOCK, cols)
