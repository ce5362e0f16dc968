"""Hybrid: a tensor whose rowwise copy (forward GEMM) and columnwise copy (backward GEMMs) use different
quantizers. `Hybrid(Q, Q)` is the same as `Q` and gives the same bits."""
from __future__ import annotations

import dataclasses

from .base import COLUMNWISE, ROWWISE, Quantizer


@dataclasses.dataclass(frozen=True)
class Hybrid(Quantizer):
    rowwise: Quantizer = None
    columnwise: Quantizer = None
    name = "hybrid"

    def __post_init__(self):
        for side in (ROWWISE, COLUMNWISE):
            q = getattr(self, side)
            if not isinstance(q, Quantizer) or isinstance(q, Hybrid):
                raise TypeError(f"Hybrid.{side} must be a plain quantizer (not None, not a Hybrid), got {q!r}")

    @property
    def label(self) -> str:
        return f"hybrid({self.rowwise.label} | {self.columnwise.label})"

    @property
    def stateful(self) -> bool:
        return self.rowwise.stateful or self.columnwise.stateful


def side(quantizer: Quantizer, axis: str) -> Quantizer:
    """The plain quantizer that makes the `axis` copy."""
    return getattr(quantizer, axis) if isinstance(quantizer, Hybrid) else quantizer


def is_same(quantizer: Quantizer) -> bool:
    return not isinstance(quantizer, Hybrid) or quantizer.rowwise == quantizer.columnwise
