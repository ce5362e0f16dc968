"""Element casts shared by the formats: saturating FP8, E2M1 codes, E8M0 exponents, power-of-2 rounding.

Everything works on float32 inputs and is plain jnp, so it is both the CPU path and the kernels' oracle.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign


def fp8_dtype(fmt: str):
    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


# mantissa bits and smallest normal exponent of the formats that values are rounded onto
_GRID = {"e4m3": (3, -6), "e5m2": (2, -14), "float16": (10, -14), "bfloat16": (7, -126)}


def round_to_grid(x, fmt: str):
    """float32 x (finite values within fmt's range) rounded to nearest even onto fmt's values, still float32,
    with exact integer and power-of-two arithmetic. XLA cannot alter this: its GPU backend may round
    float32 -> FP8 twice (through float16), and drops float32 -> float16 -> float32 round trips as "excess
    precision"; a cast of the rounded value is exact everywhere."""
    mbits, emin = _GRID[fmt]
    x = x.astype(jnp.float32)
    drop = 23 - mbits
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bias = jnp.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & jnp.uint32(1))
    out = lax.bitcast_convert_type((bits + bias) & jnp.uint32(0xFFFFFFFF ^ ((1 << drop) - 1)), jnp.float32)
    if emin > -126:  # the format's subnormals are spaced evenly, unlike float32's normals there
        step = 2.0 ** (emin - mbits)
        sub = jnp.round(x * jnp.float32(1.0 / step)) * jnp.float32(step)
        out = jnp.where(jnp.abs(x) < jnp.float32(2.0 ** emin), sub, out)
    return jnp.where(jnp.isnan(x), x, out)


def saturating_fp8(x, fmt: str):
    """Round-to-nearest-even cast to FP8 after clipping to +-max; NaN stays NaN."""
    m = FP8_MAX[fmt]
    return round_to_grid(jnp.clip(x, -m, m), fmt).astype(fp8_dtype(fmt))


def pow2_floor(x):
    """Largest power of two <= x for positive normal float32 x (clears the mantissa bits)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)


def e2m1_codes(y):
    """E2M1 code (0..15, bit 3 the sign) of float32 y, round to nearest even, saturating at +-6.

    NaN gives code 0; callers make the NaN visible through the block scale.
    """
    a = jnp.abs(y)
    mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0)).astype(jnp.uint8)
    sign = jnp.where(jnp.signbit(y), jnp.uint8(8), jnp.uint8(0))
    return mag | sign


def e2m1_codes_stochastic(y, key):
    """E2M1 codes of y rounded stochastically: up with probability equal to the distance from below."""
    import jax

    grid = jnp.asarray(E2M1_VALUES, jnp.float32)
    a = jnp.minimum(jnp.abs(y), E2M1_MAX)
    lo = (jnp.searchsorted(grid, a, side="right") - 1).clip(0, 7)
    hi = jnp.minimum(lo + 1, 7)
    glo, ghi = grid[lo], grid[hi]
    p_up = jnp.where(ghi > glo, (a - glo) / jnp.where(ghi > glo, ghi - glo, 1.0), 0.0)
    u = jax.random.uniform(key, y.shape, jnp.float32)
    mag = jnp.where(u < p_up, hi, lo).astype(jnp.uint8)
    sign = jnp.where(jnp.signbit(y), jnp.uint8(8), jnp.uint8(0))
    return mag | sign


def e2m1_decode(codes):
    """float32 values of E2M1 codes (uint8, 0..15)."""
    table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
    return table[codes.astype(jnp.int32)]


def pack_nibbles(codes):
    """Pack codes [..., n] (n even) two per byte, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed):
    lo, hi = packed & 0xF, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_round_up(q):
    """E8M0 exponent byte of positive float32 q, rounded up so q <= 2**(e-127) (JAX's MX convention).

    Non-finite q gives 0xFF (the E8M0 NaN).
    """
    bits = lax.bitcast_convert_type(q.astype(jnp.float32), jnp.uint32)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    round_up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    exp = jnp.where(round_up, exp + 1, exp)
    exp = jnp.where(jnp.isfinite(q), exp, 0xFF)
    return exp.astype(jnp.uint8)


def e8m0_to_f32(e):
    """2**(e-127) as float32 (e = 0 gives the subnormal 2**-127; 0xFF gives NaN)."""
    e32 = e.astype(jnp.uint32)
    normal = lax.bitcast_convert_type(e32 << 23, jnp.float32)
    val = jnp.where(e32 == 0, jnp.float32(2.0 ** -127), normal)
    return jnp.where(e32 == 0xFF, jnp.float32(jnp.nan), val)


def e8m0_reciprocal(e):
    """2**(127-e) as a normal float32, for e in [0, 253]; NaN for 0xFF."""
    e32 = e.astype(jnp.uint32)
    inv = lax.bitcast_convert_type((jnp.uint32(254) - jnp.minimum(e32, 253)) << 23, jnp.float32)
    return jnp.where(e32 == 0xFF, jnp.float32(jnp.nan), inv)


def as_e8m0(e_bytes):
    return lax.bitcast_convert_type(e_bytes, jnp.float8_e8m0fnu)


def e8m0_bytes(scale):
    return lax.bitcast_convert_type(scale, jnp.uint8)
