"""Shared checks for the FFI tests (CPU, GPU, sharding): kernel copies against the jnp reference, bit for bit.

No tests here; a test_ name so that it sits with the FFI tests."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxhq.formats import (MXFP8, NVFP4, Float8Block, Float8CurrentScaling, Float8DelayedScaling, Hybrid,
                           Identity, init_state)
from jaxhq.formats.base import USAGES
from jaxhq.formats.hybrid import side

SINGLE = [Float8CurrentScaling(), Float8CurrentScaling("e5m2", power_2_scale=True), MXFP8(), MXFP8("e5m2"),
          NVFP4(), NVFP4(block_2d=True), NVFP4(rht=True), Float8Block(), Float8Block((128, 128)),
          Float8Block(power_2_scale=False)]
HYBRID = [Hybrid(MXFP8(), Float8Block((128, 128))), Hybrid(Float8Block(), NVFP4(rht=True)),
          Hybrid(NVFP4(block_2d=True), MXFP8("e5m2")), Hybrid(Float8CurrentScaling(), NVFP4()),
          Hybrid(MXFP8(), Identity())]
SHAPES = [(64, 96), (33, 50), (256, 160), (130, 272), (1, 7), (300, 17)]


def random_input(key, shape, dtype):
    """Normal values times a log-normal spread (many binades, so every scale path is exercised)."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(2.0 * jax.random.normal(k2, shape, jnp.float32))
    return x.astype(dtype)


def bf16_rounding_input(key, shape):
    """float32 values that round to bfloat16 every way: random ones, and ties to even in both directions (up,
    down, negative, at the smallest normal binade) in the first four elements."""
    x = random_input(key, shape, jnp.float32)
    ties = jnp.asarray([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(2 + 2 ** -7), 2 ** -126 * (1 + 2 ** -8)], jnp.float32)
    return x.reshape(-1).at[:4].set(ties).reshape(shape)


def tiny_input(key, shape, ordinary_from=None):
    """Normal float32 values near 1e-37 of random sign (amax below 448 / FLT_MAX: the FP8 scale 448 / amax
    overflows); columns from `ordinary_from` on are scaled to ordinary magnitudes (blocks of both kinds)."""
    k1, k2 = jax.random.split(key)
    mag = jax.random.uniform(k1, shape, jnp.float32, 0.05, 1.0) * 1e-37
    x = jnp.where(jax.random.bernoulli(k2, 0.5, shape), mag, -mag)
    return x if ordinary_from is None else x.at[:, ordinary_from:].multiply(1e37)


def spy_launches(monkeypatch) -> list:
    """Records every quantize launch traced from here on (x's shape and dtype, the row and column (format, options)
    pairs) by wrapping jaxhq.ffi.primitives.quantize; returns the list it fills. Skips the test where the extension
    is not built (no launch is traced then: every copy is the reference's)."""
    import pytest

    from jaxhq import ffi
    from jaxhq.ffi import primitives as P
    if not ffi.available("cpu"):
        pytest.skip("jaxhq FFI extension not built: no launch to spy on")
    launches, orig = [], P.quantize

    def spy(x, scales, seed, row=(P.NONE, 0), col=(P.NONE, 0), **kw):
        launches.append((tuple(x.shape), jnp.dtype(x.dtype), row, col))
        return orig(x, scales, seed, row, col, **kw)

    monkeypatch.setattr(P, "quantize", spy)
    return launches


def as_bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return np.atleast_1d(a).view(np.uint8) if a.dtype.itemsize > 1 or a.dtype == np.uint8 else \
        np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint8)).reshape(-1)


def decoded_values(data, scale, nvfp4: bool, e5m2: bool, r: int, c: int, rows_inner: bool = False) -> np.ndarray:
    """The bytes of a decoded copy ([r, c] bfloat16: each code's value times its block scale, NVFP4 without its
    global scale) made from a copy's code and scale bytes by ml_dtypes decodes. rows_inner: MXFP8 scale bytes as
    the quantize launch writes them, [blocks, r] (ffi.primitives.launch_scale_shape_dtype), not [r, blocks]."""
    data, scale = as_bytes(data), as_bytes(scale)
    if rows_inner:
        scale = np.ascontiguousarray(scale.reshape(-1, r).T).reshape(-1)
    if nvfp4:
        nib = np.stack([data & 15, data >> 4], axis=-1).reshape(r, -1)[:, :c]
        vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        block, per = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(r, -1), 16
    else:
        vals = data.view(ml_dtypes.float8_e5m2 if e5m2 else ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(r, c)
        block, per = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32).reshape(r, -1), 32
    v = vals * np.repeat(block, per, axis=1)[:, :c]
    return v.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(-1)


def reference_copies(x2d, q, usage, *, key=None, state=None):
    """The reference's copies, compiled as one jit (as the training step would run it)."""
    return _reference_jit(x2d, q, tuple(usage), key, state)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _reference_jit(x2d, q, usage, key, state):
    out = {}
    for a in usage:
        sq = side(q, a)
        arr = x2d if a == "rowwise" else x2d.T
        st = state.get(a) if isinstance(q, Hybrid) and state is not None else state
        sk = None if key is None else jax.random.fold_in(key, USAGES.index(a))
        out[a] = sq.quantize_2d(arr, a, key=sk, state=st)
    return out


def applicable(q, shape) -> bool:
    m, k = shape
    for a, (rows, cols) in (("rowwise", (m, k)), ("columnwise", (k, m))):
        sq = side(q, a)
        if isinstance(sq, NVFP4) and sq.uses_rht(a) and cols % 16:
            return False
    return True


def compare(got: dict, ref: dict, label: str) -> list:
    """Names of the fields that differ (by bytes), empty when bit-equal."""
    bad = []
    for a, r in ref.items():
        g = got[a]
        for f in ("data", "scale_inv", "amax"):
            rv, gv = getattr(r, f), getattr(g, f)
            if rv is None and gv is None:
                continue
            if rv is None or gv is None or np.shape(rv) != np.shape(gv) or jnp.dtype(rv.dtype) != jnp.dtype(gv.dtype):
                bad.append(f"{label} {a}.{f}: shape/dtype {np.shape(gv)}/{getattr(gv, 'dtype', None)} vs "
                           f"{np.shape(rv)}/{getattr(rv, 'dtype', None)}")
                continue
            gb, rb = as_bytes(gv), as_bytes(rv)
            if not np.array_equal(gb, rb):
                bad.append(f"{label} {a}.{f}: {int((gb != rb).sum())} of {gb.size} bytes differ")
        if g.shape != r.shape or g.quantizer != r.quantizer:
            bad.append(f"{label} {a}: metadata differs")
    return bad


def state_for(q):
    st = init_state(q)
    if st is None:
        return None
    # a non-trivial scale so the delayed path is exercised
    f = lambda s: {**s, "scale": jnp.float32(3.0)}  # noqa: E731
    return {k: f(v) for k, v in st.items()} if isinstance(q, Hybrid) else f(st)


DELAYED = Float8DelayedScaling()
