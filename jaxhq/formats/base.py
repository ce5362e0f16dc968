"""The quantizer base class and the pytrees that carry quantized data.

Layout contract (every GEMM operand is K-major, blocks along its last axis): a tensor is flattened to 2D
[M, K]. Its rowwise storage quantizes along K and keeps data [M, K]; its columnwise storage is the rowwise
quantization of the transpose, data [K, M], blocks along M.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

ROWWISE, COLUMNWISE = "rowwise", "columnwise"
USAGES = (ROWWISE, COLUMNWISE)
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class QuantizationError(ValueError):
    """A tensor that a quantizer cannot take (rank, dtype, shape); the message names all three."""


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """How to quantize one copy of a tensor. Frozen and hashable: static under jit.

    Subclasses implement `quantize_2d` (blocks along the last axis of a 2D array) and `dequantize_2d`.
    """

    name = "quantizer"
    stateful = False

    @property
    def label(self) -> str:
        return self.name

    def quantize_2d(self, x2d, axis: str, *, key=None, state=None, amax=None) -> "Storage":
        raise NotImplementedError

    def dequantize_2d(self, s: "Storage"):
        raise NotImplementedError

    def check_shape(self, rows: int, cols: int, axis: str) -> None:
        """Raise QuantizationError when a [rows, cols] copy cannot be quantized by this format."""

    def __str__(self) -> str:
        return self.label


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Storage:
    """One copy of a quantized tensor: data, inverse scales and (per-tensor formats) the amax.

    `shape` is the logical 2D shape of this copy ([M, K] rowwise, [K, M] columnwise). A `decoded` copy holds the
    values of its codes instead of the codes; a `transposed` one holds them transposed (see the fields).
    """

    data: Any
    scale_inv: Any = None
    amax: Any = None
    quantizer: Quantizer = dataclasses.field(default=None, metadata=dict(static=True))
    axis: str = dataclasses.field(default=ROWWISE, metadata=dict(static=True))
    shape: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # MXFP8 / NVFP4 made by the kernels for a GEMM that reads values (the dequantize path of Hopper): `data` is
    # bfloat16 [rows, cols], each code times its block scale (NVFP4: not the global one); `scale_inv` as usual.
    decoded: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # A decoded copy that is the other orientation's copy read transposed: `data` (bf16 [cols, rows]), `scale_inv`
    # and `amax` are that copy's, unchanged. Made where both copies hold the same values (`transpose_of`).
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def dequantize(self):
        """float32 values in this copy's layout, with any transform (RHT) undone."""
        if self.transposed:
            return self.transpose_of().dequantize().T
        return self.quantizer.dequantize_2d(self)

    def transpose_of(self) -> "Storage":
        """The other orientation's copy as this one reads it transposed (`transposed` flips; the arrays stay)."""
        other = ROWWISE if self.axis == COLUMNWISE else COLUMNWISE
        return dataclasses.replace(self, axis=other, shape=self.shape[::-1], transposed=not self.transposed)

    @property
    def format(self) -> str:
        return self.quantizer.label

    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in (self.data, self.scale_inv, self.amax) if a is not None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized tensor: optional rowwise and columnwise storages, the logical shape and original dtype."""

    rowwise: Optional[Storage] = None
    columnwise: Optional[Storage] = None
    shape: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape2d(self) -> tuple:
        return (math.prod(self.shape[:-1]), self.shape[-1])

    def get(self, axis: str) -> Storage:
        s = getattr(self, axis)
        if s is None:
            raise ValueError(f"quantized tensor of shape {self.shape} has no {axis} copy")
        return s

    def dequantize(self, axis: Optional[str] = None):
        """The logical tensor in its original dtype, from the rowwise copy (or the columnwise one)."""
        if axis is None:
            axis = ROWWISE if self.rowwise is not None else COLUMNWISE
        x2d = self.get(axis).dequantize()
        if axis == COLUMNWISE:
            x2d = x2d.T
        return x2d.reshape(self.shape).astype(self.dtype)


def check_input(x, quantizer) -> None:
    if x.ndim < 2:
        raise QuantizationError(
            f"cannot quantize a tensor of shape {tuple(x.shape)} (rank {x.ndim}) with {quantizer}: rank >= 2 needed")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise QuantizationError(
            f"cannot quantize a tensor of shape {tuple(x.shape)} and dtype {x.dtype} with {quantizer}: "
            "float32, bfloat16 or float16 needed")


def pad_last(x, multiple: int):
    """Zero-pad the last axis to a multiple (zeros never change an amax)."""
    n = x.shape[-1]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
    return jnp.pad(x, widths)


def pad_to(x, rows_multiple: int, cols_multiple: int):
    rpad, cpad = (-x.shape[0]) % rows_multiple, (-x.shape[1]) % cols_multiple
    if rpad == 0 and cpad == 0:
        return x
    return jnp.pad(x, ((0, rpad), (0, cpad)))


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def abs_bits(x):
    """|x| as unsigned integers of x's width: its bit patterns with the sign bit cleared. They order as the
    values do, with every NaN pattern above Inf, so one integer max is a NaN-propagating max |x| (floats of
    1, 2 or 4 bytes)."""
    ut = _UINT[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, ut) & ut((1 << (8 * x.dtype.itemsize - 1)) - 1)


def canonical_nan(x):
    """x with every NaN made the canonical NaN of its dtype (the bits a NaN amax is recorded with)."""
    return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, x.dtype), x)


def _bit_max(x, axis=None):
    """max |x| as the integer max of `abs_bits(x)`, in x's dtype; a NaN of one of x's patterns when any is NaN."""
    return lax.bitcast_convert_type(jnp.max(abs_bits(x), axis=axis), x.dtype)


def _bit_maxable(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _UINT


def abs_max(x, axis=None):
    """max |x| that is the canonical NaN when any element is NaN.

    Taken as the integer max of `abs_bits(x)`: one reduction, where a float max (which may drop NaNs in XLA)
    and a NaN test were two. On an H100, XLA fuses this single reduction into the op that produces x (a
    multi-output fusion: x is not read again), which it did not do for the pair (8192 x 14336 bf16 producer +
    amax + quantize: 3 kernels and 0.444 ms against 6 and 0.530; 0.426 with no amax at all).
    """
    x = jnp.asarray(x)
    if not _bit_maxable(x):  # float64, integers
        a = jnp.abs(x)
        return jnp.where(jnp.any(jnp.isnan(a), axis=axis), jnp.asarray(jnp.nan, a.dtype), jnp.max(a, axis=axis))
    return canonical_nan(_bit_max(x, axis))


def abs_max_f32(x):
    """max |x| over every element as float32, a NaN of unspecified bits when any element is NaN: the form the
    kernels take (no canonicalising select after the reduction). For bfloat16 the max is taken over the
    float32 patterns (the bfloat16 ones shifted up), so the reduction's result is the float32 bits and XLA
    runs no small kernel after it to convert."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(jnp.max(abs_bits(x).astype(jnp.uint32) << 16), jnp.float32)
    return (_bit_max(x) if _bit_maxable(x) else abs_max(x)).astype(jnp.float32)


def block_amax(x2d, block: int):
    """Max |x| per 1 x block block of a 2D array padded to a block multiple: [rows, cols/block]."""
    rows, cols = x2d.shape
    return abs_max(x2d.reshape(rows, cols // block, block), axis=-1)


def expand_blocks(scale, block: int, cols: int):
    """Repeat per-block values along the last axis and cut to `cols`."""
    return jnp.repeat(scale, block, axis=-1)[..., :cols]
