"""FP8 blockwise (DeepSeek-V3 style): E4M3 elements, an fp32 scale per 1x128 block or 128x128 tile.

Per block: scale = 448 / amax (1 when amax is 0, at most 2^126), optionally rounded down to a power of 2; data is
the saturating cast of x * scale; scale_inv = 1 / scale is stored, [rows, ceil(cols/128)] for 1x128 and
[ceil(rows/128), ceil(cols/128)] for 128x128. Partial blocks are zero-padded inside. With 128x128 tiles the
columnwise copy is the exact transpose of the rowwise one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import ROWWISE, QuantizationError, Quantizer, Storage, abs_max, block_amax, pad_to
from .casts import FP8_MAX, saturating_fp8
from .fp8 import scale_from_amax

BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Float8Block(Quantizer):
    block: tuple = (1, BLOCK)
    power_2_scale: bool = True
    name = "fp8_block"
    fmt = "e4m3"

    def __post_init__(self):
        if tuple(self.block) not in ((1, BLOCK), (BLOCK, BLOCK)):
            raise QuantizationError(f"Float8Block block must be (1, 128) or (128, 128), got {self.block}")
        object.__setattr__(self, "block", tuple(self.block))

    @property
    def label(self) -> str:
        return f"fp8_block_{self.block[0]}x{self.block[1]}"

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        rows, cols = x2d.shape
        br, bc = self.block
        xp = pad_to(x2d.astype(jnp.float32), br, bc)
        prow, pcol = xp.shape
        amax_b = block_amax(xp, bc)
        if br > 1:
            amax_b = abs_max(amax_b.reshape(prow // br, br, pcol // bc), axis=1)
        scale = jax.lax.optimization_barrier(scale_from_amax(amax_b, self.fmt, 0.0, self.power_2_scale))
        full = jnp.repeat(jnp.repeat(scale, br, axis=0), bc, axis=1)
        data = saturating_fp8(xp * full, self.fmt)[:rows, :cols]
        return Storage(data=data, scale_inv=(1.0 / scale).astype(jnp.float32), quantizer=self, axis=axis,
                       shape=(rows, cols))

    def dequantize_2d(self, s: Storage):
        rows, cols = s.shape
        br, bc = self.block
        full = jnp.repeat(jnp.repeat(s.scale_inv, br, axis=0), bc, axis=1)[:rows, :cols]
        return s.data.astype(jnp.float32) * full


__all__ = ["Float8Block", "FP8_MAX"]
