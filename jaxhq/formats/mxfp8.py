"""MXFP8: 1x32 blocks, an E8M0 (power of two) scale per block, E4M3 or E5M2 elements.

Per block: q = amax / fmt_max, computed in the input dtype (JAX's MX convention); the scale exponent is q's
rounded up, so no element saturates; elements are x / 2**e cast round-to-nearest-even. This matches
`jax._src.cudnn.scaled_matmul_stablehlo.quantize` bit for bit, except that an all-zero block gives zeros
(scale byte 0, i.e. 2**-127) where JAX's divides 0 by a flushed 0 and gives NaN, and that a block holding
NaN/Inf gets the E8M0 NaN scale (0xFF). Scales are float8_e8m0fnu [rows, ceil(cols/32)], row-major.
A last block that the row length does not fill is zero-padded inside; the data keeps the logical shape.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import ROWWISE, Quantizer, Storage, block_amax, expand_blocks, pad_last
from .casts import (FP8_MAX, as_e8m0, e8m0_bytes, e8m0_reciprocal, e8m0_round_up, e8m0_to_f32, fp8_dtype,
                    saturating_fp8, round_to_grid)

MX_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class MXFP8(Quantizer):
    fmt: str = "e4m3"
    name = "mxfp8"
    block = MX_BLOCK

    def __post_init__(self):
        fp8_dtype(self.fmt)

    @property
    def label(self) -> str:
        return f"mxfp8_{self.fmt}"

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        rows, cols = x2d.shape
        xp = pad_last(x2d, MX_BLOCK)
        amax_b = block_amax(xp, MX_BLOCK)  # exact in the input dtype
        q = amax_b.astype(jnp.float32) * jnp.float32(1.0 / FP8_MAX[self.fmt])
        if x2d.dtype != jnp.float32:  # rounded to the input dtype, as JAX's MX quantize computes it
            q = round_to_grid(q, jnp.dtype(x2d.dtype).name)
        e = e8m0_round_up(q)
        inv = expand_blocks(e8m0_reciprocal(e), MX_BLOCK, cols)
        data = saturating_fp8(x2d.astype(jnp.float32) * inv, self.fmt)
        return Storage(data=data, scale_inv=as_e8m0(e), quantizer=self, axis=axis, shape=(rows, cols))

    def dequantize_2d(self, s: Storage):
        if s.decoded:  # the codes times their scales already, exactly (within bf16's range)
            return s.data.astype(jnp.float32)
        scale = expand_blocks(e8m0_to_f32(e8m0_bytes(s.scale_inv)), MX_BLOCK, s.shape[1])
        return s.data.astype(jnp.float32) * scale
