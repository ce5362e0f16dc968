"""FP8 per-tensor formats: current scaling (scale from this tensor's amax) and delayed scaling (from a history).

scale = fmt_max / max(amax, eps) (1.0 when that is 0, at most MAX_SCALE = 2^126), optionally rounded down to a
power of 2; data is the saturating round-to-nearest-even cast of x * scale; scale_inv = 1 / scale. A NaN or Inf
in the input makes the amax non-finite, which makes every dequantized value NaN: nothing is silently clipped to a
finite value.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import ROWWISE, Quantizer, Storage, abs_max
from .casts import FP8_MAX, fp8_dtype, pow2_floor, saturating_fp8


def tensor_amax(x2d):
    return abs_max(x2d).astype(jnp.float32)


# The largest scale: a tiny amax (a block of gradients near 1e-37) made fmt_max / amax overflow to inf, and
# 0 * inf = NaN, or scale_inv a float32 subnormal that flushes to 0. Capped, scale_inv stays a normal float and
# x * scale stays below fmt_max.
MAX_SCALE = 2.0 ** 126


def scale_from_amax(amax, fmt: str, eps: float = 0.0, power_2: bool = False):
    a = jnp.maximum(amax, jnp.float32(eps))
    scale = jnp.where(a == 0, jnp.float32(1.0), jnp.float32(FP8_MAX[fmt]) / a)
    scale = jnp.minimum(scale, jnp.float32(MAX_SCALE))
    # amax = NaN/Inf: scale NaN/0, so the dequantized tensor is NaN rather than finite garbage.
    scale = jnp.where(jnp.isnan(amax), jnp.float32(jnp.nan), scale)
    if power_2:
        scale = jnp.where(jnp.isfinite(scale) & (scale > 0), pow2_floor(scale), scale)
    return scale


def cast_with_scale(x2d, scale, fmt: str, axis: str, amax, quantizer) -> Storage:
    data = saturating_fp8(x2d.astype(jnp.float32) * scale, fmt)
    return Storage(data=data, scale_inv=(1.0 / scale).astype(jnp.float32), amax=amax,
                   quantizer=quantizer, axis=axis, shape=tuple(x2d.shape))


class _PerTensor(Quantizer):
    def dequantize_2d(self, s: Storage):
        return s.data.astype(jnp.float32) * s.scale_inv

    @property
    def dtype(self):
        return fp8_dtype(self.fmt)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_PerTensor):
    """FP8 with one scale per tensor computed from the tensor's own amax (global across the mesh)."""

    fmt: str = "e4m3"
    amax_epsilon: float = 0.0
    power_2_scale: bool = False
    name = "fp8"

    def __post_init__(self):
        fp8_dtype(self.fmt)

    @property
    def label(self) -> str:
        return f"fp8_{self.fmt}" + ("_p2" if self.power_2_scale else "")

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        if amax is None:
            amax = tensor_amax(x2d)
        scale = scale_from_amax(amax, self.fmt, self.amax_epsilon, self.power_2_scale)
        return cast_with_scale(x2d, scale, self.fmt, axis, amax, self)


@dataclasses.dataclass(frozen=True)
class Float8DelayedScaling(_PerTensor):
    """FP8 with a per-tensor scale taken from an amax history (state {amax_history, scale}, passed in and out).

    The cast uses `state["scale"]`; the storage records this step's amax; `update_state` rolls the history
    and computes the next scale = fmt_max / amax_compute(history) / 2**margin, keeping the old scale when the
    reduced amax is 0 or non-finite.
    """

    fmt: str = "e4m3"
    history_len: int = 1024
    amax_compute: str = "max"
    margin: int = 0
    name = "fp8_delayed"
    stateful = True

    def __post_init__(self):
        fp8_dtype(self.fmt)
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")
        if self.history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")

    @property
    def label(self) -> str:
        return f"fp8_{self.fmt}_delayed"

    def init_state(self):
        return {"amax_history": jnp.zeros((self.history_len,), jnp.float32), "scale": jnp.ones((), jnp.float32)}

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        if state is None:
            raise ValueError(f"{self.label} needs its state {{amax_history, scale}}: pass state=init_state() "
                             "or use a layer that keeps it")
        if amax is None:
            amax = tensor_amax(x2d)
        return cast_with_scale(x2d, state["scale"].astype(jnp.float32), self.fmt, axis, amax, self)

    def update_state(self, state, amax):
        # hist = [amax, old[:-1]]; its max is taken as max(amax, max(old[:-1])), which reads the old history
        # only, so the reduction does not wait for the shift: three kernels per quantizer on an H100 (shift,
        # reduction, scale), where a roll and a reduce over its result were four.
        amax = amax.astype(jnp.float32)
        old = state["amax_history"]
        hist = jnp.concatenate([amax[None], old[:-1]])
        if self.amax_compute == "max":
            reduced = jnp.maximum(amax, jnp.max(old[:-1])) if old.shape[0] > 1 else amax
        else:
            reduced = amax
        new = jnp.minimum(jnp.float32(FP8_MAX[self.fmt]) / reduced / jnp.float32(2.0 ** self.margin),
                          jnp.float32(MAX_SCALE))
        ok = (reduced > 0) & jnp.isfinite(reduced)
        return {"amax_history": hist, "scale": jnp.where(ok, new, state["scale"]).astype(jnp.float32)}
