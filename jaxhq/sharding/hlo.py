"""Collectives in compiled HLO text: what each all-gather (or other collective) moves, by dtype and shape.

Used by the tests (weight all-gathers must carry uint8/FP8, not bf16) and by benchmarks/fsdp.py (bytes
gathered per step). Reads `jit(f).lower(...).compile().as_text()`; counts the synchronous form and the
`-start` half of async pairs (never the `-done`), and splits combined (tuple) collectives into their arrays.
Collectives whose replica groups are single devices (no-ops, e.g. a shard_map transpose over size-1 axes) are
skipped: they move nothing.
"""
from __future__ import annotations

import dataclasses
import math
import re

BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e8m0fnu": 8,
        "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e3m4": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16,
        "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_NOOP = re.compile(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}")
_OP = re.compile(r"=\s*(.*?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One array a collective produces: kind (all-gather, ...), element type, shape and bytes."""

    kind: str
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * BITS.get(self.dtype, 0) // 8


def collectives(hlo_text: str, kind: str = "all-gather") -> list:
    """Every array produced by collectives of `kind` (None: all kinds) in the HLO text of one module."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m or (kind is not None and m.group(2) != kind) or _NOOP.search(line):
            continue
        arrays = [(d, tuple(int(s) for s in shp.split(",") if s)) for d, shp in _ARRAY.findall(m.group(1))]
        if m.group(3) and m.group(2) != "all-reduce" and len(arrays) % 2 == 0 and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2:]  # async start: (operands, outputs); keep the outputs
        out.extend(Collective(m.group(2), d, s) for d, s in arrays if d in BITS)
    return out


def gathered_bytes(hlo_text: str) -> int:
    """Bytes that all-gathers produce per device per call (the gathered arrays' sizes)."""
    return sum(c.nbytes for c in collectives(hlo_text, "all-gather"))


def by_dtype(cols) -> dict:
    acc = {}
    for c in cols:
        acc[c.dtype] = acc.get(c.dtype, 0) + c.nbytes
    return acc
