"""Identity: keeps a slot in high precision (optionally cast to a given dtype); no scale."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .base import ROWWISE, Quantizer, Storage


@dataclasses.dataclass(frozen=True)
class Identity(Quantizer):
    dtype: Any = None
    name = "identity"

    def __post_init__(self):
        if self.dtype is not None:
            object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @property
    def label(self) -> str:
        return "identity" if self.dtype is None else f"identity_{jnp.dtype(self.dtype).name}"

    def quantize_2d(self, x2d, axis: str = ROWWISE, *, key=None, state=None, amax=None) -> Storage:
        data = x2d if self.dtype is None else x2d.astype(self.dtype)
        return Storage(data=data, quantizer=self, axis=axis, shape=tuple(x2d.shape))

    def dequantize_2d(self, s: Storage):
        return s.data.astype(jnp.float32)
