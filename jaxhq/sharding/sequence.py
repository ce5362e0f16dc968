"""Sequence parallelism in the dense op: quantize where the tokens lie, gather the quantized bytes, reduce-scatter.

Under `axis_rules(sequence_parallel=True)` the residual stream [batch, length, embed] is split on length over the
tensor axis, as in Megatron. A column-parallel dense (kernel out dim on that axis: qkv, fc1, the LM head)
quantizes its input on each device (its own tokens; per-tensor amaxes are global, as everywhere under jit) and
all-gathers the quantized copies over the tensor axis, codes and scales as raw bytes; a row-parallel dense
(kernel in dim on it: proj, fc2) multiplies on each device and reduce-scatters the partial sums onto the
length split instead of all-reducing them. The backward mirrors both: the column-parallel dgrad is
reduce-scattered, the row-parallel grad_output quantized per shard and gathered.

Token order: the dense op flattens [B, L, K] batch-major. A device holds B/nb sequences x L/tp tokens, which is
not a contiguous run of those rows, so the per-shard copies are quantized in shard-major order (rows (tensor
shard, batch, position within the shard): a contiguous split, free to form) and the all-gather, along the
position dim of each sequence, puts them back batch-major; the reduce-scatter cuts the same dim. The GEMMs
then read exactly the rows they read unsharded. A block that runs along tokens (the columnwise copies; 16x16
or 128x128 tiles) must not straddle two shards, nor two sequences: where L/tp is not a multiple of it, that
tensor falls back to the partitioner's high-precision path, with a warning that names it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..formats import (COLUMNWISE, ROWWISE, USAGES, Float8CurrentScaling, Float8DelayedScaling, Identity, QTensor,
                       Storage, normalize, side)
from .gather import block_shape, mesh_ways, raw_bits


@dataclasses.dataclass(frozen=True)
class SequencePlan:
    """What a dense op under sequence parallelism does, fixed at trace time (static under jit).

    column: column-parallel (gathers its input, reduce-scatters its dgrad) or row-parallel (reduce-scatters
    its output, gathers its grad_output). gathered / scattered: whether that gather / reduce-scatter runs here
    (False: the tensor fell back to the partitioner). lead: (B, L) of the op's input [B, L, K].
    """

    mesh: Any
    batch: tuple  # mesh axes (size > 1) the batch dim is split on
    axes: tuple  # mesh axes (size > 1) the length dim is split on
    lead: tuple
    column: bool
    gathered: bool
    scattered: bool

    def gathers(self, slot: str) -> bool:
        """Whether `slot`'s tensor is quantized per length shard and gathered (input or grad_output)."""
        return self.gathered and slot == ("input" if self.column else "grad_output")

    def scatters(self, gemm_name: str) -> bool:
        """Whether the GEMM `gemm_name` (forward or dgrad) is reduce-scattered onto the length split."""
        return self.scattered and gemm_name == ("dgrad" if self.column else "forward")

    @property
    def ways(self) -> int:
        return mesh_ways(self.mesh, self.axes)

    @property
    def local_batch(self) -> int:
        return self.lead[0] // mesh_ways(self.mesh, self.batch)

    def _sharding(self, *spec):
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def tokens(self, t):
        """t [B, L, K] split (batch, length) -> its rows [B L, K] in shard-major order, each device's rows its
        own tokens (no data moves)."""
        b, length = self.lead
        t = jax.lax.with_sharding_constraint(t, self._sharding(self.batch or None, self.axes, None))
        t = t.reshape(b, self.ways, length // self.ways, t.shape[-1]).transpose(1, 0, 2, 3)
        return jax.lax.with_sharding_constraint(t.reshape(-1, t.shape[-1]), self._sharding(self.axes + self.batch))

    @staticmethod
    def transposes(q) -> bool:
        """Whether q's columnwise copy is its rowwise copy transposed (one per-tensor FP8 or Identity quantizer
        for both): then only the rowwise copy is quantized and gathered, and transposed where it lies."""
        return isinstance(normalize(q), (Float8CurrentScaling, Float8DelayedScaling, Identity))

    def quantize(self, quantize_fn, q, usage, gather_columnwise: bool = True) -> QTensor:
        """`quantize_fn(usage)`, the QTensor of `tokens` rows quantized by q, with its copies gathered: the
        rowwise one, and the columnwise one unless `gather_columnwise` is False (a residual: the backward gathers
        it, see `columnwise`). Where q `transposes`, the columnwise copy is the gathered rowwise one transposed."""
        if not self.transposes(q):
            qt = quantize_fn(usage)
            col = qt.columnwise
            return dataclasses.replace(qt, rowwise=self.gather(qt.rowwise), columnwise=self.gather(col) if
                                       gather_columnwise and col is not None else col)
        qt = quantize_fn((ROWWISE,))
        row = self.gather(qt.rowwise)
        col = dataclasses.replace(row, data=row.data.T, axis=COLUMNWISE, shape=row.shape[::-1])
        return dataclasses.replace(qt, rowwise=row, columnwise=col if COLUMNWISE in usage else None)

    def columnwise(self, s: Storage, q) -> Storage:
        """The columnwise copy that `quantize(..., gather_columnwise=False)` returned, gathered."""
        return s if self.transposes(q) else self.gather(s)

    def gather(self, s: Storage) -> Storage:
        """A copy quantized from `tokens` rows -> the same copy batch-major, tokens split on the batch axes only:
        each array's token dim (rows of a rowwise copy, columns of a columnwise one) all-gathered over the
        length axes as raw bytes, along the positions of each local sequence."""
        t = 0 if s.axis == ROWWISE else 1
        nb = self.local_batch

        def spec(axes):
            return lambda a: PartitionSpec() if a.ndim == 0 else PartitionSpec(*(axes if d == t else None
                                                                                 for d in range(a.ndim)))

        def one(a):
            if a.ndim == 0:  # per-tensor scale or amax: global already
                return a
            bits, back = raw_bits(a)
            n = bits.shape[t]
            split = bits.reshape(bits.shape[:t] + (nb, n // nb) + bits.shape[t + 1:])
            full = jax.lax.all_gather(split, self.axes, axis=t + 1, tiled=True)
            return back(full.reshape(bits.shape[:t] + (n * self.ways,) + bits.shape[t + 1:]))

        return jax.shard_map(lambda s: jax.tree.map(one, s), mesh=self.mesh,
                             in_specs=(jax.tree.map(spec(self.axes + self.batch), s),),
                             out_specs=jax.tree.map(spec(self.batch or None), s), check_vma=False)(s)

    def scatter_gemm(self, gemm_fn, a: Storage, b: Storage, b_spec: PartitionSpec):
        """y [B, L, N] = a . b^T for a [B L, K] (tokens on the batch axes, K on the length axes) and b [N, K]
        laid out as `b_spec` (K on the length axes): each device multiplies its K slice, and the partial sums are
        reduce-scattered onto (batch, length) in the output's dtype."""
        length = self.lead[1]
        nb, tp = self.local_batch, self.ways

        def specs(s, spec):
            return jax.tree.map(lambda x: PartitionSpec() if x.ndim == 0 else spec, s)

        def local(s, rows_ways):
            return dataclasses.replace(s, shape=(s.shape[0] // rows_ways, s.shape[1] // tp))

        def body(a, b):
            y = gemm_fn(local(a, mesh_ways(self.mesh, self.batch)), local(b, mesh_ways(self.mesh, b_spec[0])))
            y = y.reshape(nb, tp, length // tp, y.shape[-1])
            y = jax.lax.psum_scatter(y, self.axes, scatter_dimension=1, tiled=True)
            return y.reshape(nb, length // tp, y.shape[-1])

        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=(specs(a, PartitionSpec(self.batch or None, self.axes)), specs(b, b_spec)),
                             out_specs=PartitionSpec(self.batch or None, self.axes, None), check_vma=False)(a, b)


def _fallback(what: str, why: str) -> None:
    warnings.warn(f"sequence parallelism: {what}: {why}; this tensor takes the partitioner's path, which moves it "
                  "in high precision (all-gather, or all-reduce and slice), as without sequence parallelism",
                  stacklevel=4)


def _token_blocks(q, tokens: int):
    """(axis, label, block) of the first copy of `q` whose blocks along tokens (columnwise blocks, or 2D tiles)
    do not divide `tokens`, else None."""
    q = normalize(q)
    for axis in USAGES:
        sq = side(q, axis)
        br, bc = block_shape(sq)
        block = br if axis == ROWWISE else bc
        if tokens % block:
            return axis, sq.label, block
    return None


def sequence_plan(wsh, x_shape: tuple, qs, n_out: int) -> Optional[SequencePlan]:
    """The SequencePlan of a dense op with kernel sharding `wsh` (a WeightSharding), input shape `x_shape` and
    quantizers `qs` (a DenseQuantizers), kernel [K, n_out]; None when the op is not sequence parallel (no length
    split in the rules, an input that is not [batch, length, features], a kernel that is neither column- nor
    row-parallel on the length axes). Warns for each tensor that falls back (see the module docstring)."""
    if wsh is None or len(x_shape) != 3:
        return None
    axes = wsh.split(wsh.sequence)
    if not axes:
        return None
    k_in, k_out = (wsh.split(e) for e in wsh.kernel_spec(gathered=True))
    if (k_out, k_in) == (axes, ()):
        column = True
    elif (k_in, k_out) == (axes, ()):
        column = False
    else:
        return None
    batch = wsh.split(wsh.batch)
    bsz, length, k = x_shape
    tp, nb = wsh.ways(axes), wsh.ways(batch)
    who = f"{'column' if column else 'row'}-parallel dense {wsh.name or '(unnamed)'}"
    if bsz % nb or length % tp:
        _fallback(who, f"its input {list(x_shape)} cannot be split evenly: batch {bsz} over {nb} devices "
                       f"{batch}, length {length} over {tp} devices {axes}")
        return None
    slot = "input" if column else "grad_output"
    bad = _token_blocks(getattr(qs, slot), length // tp)
    if bad is not None:
        axis, label, block = bad
        rows = (bsz * length, k if column else n_out)
        shape = list(rows) if axis == ROWWISE else list(rows[::-1])
        _fallback(f"{slot} {qs.role(slot) or who}", f"its {axis} copy {shape} ({label}) has blocks of {block} "
                  f"tokens, and each device holds {length // tp} tokens of each sequence ({length} over {tp} "
                  f"devices {axes}): blocks would straddle shards. Make the sequence length a multiple of "
                  f"{tp} x {block} = {tp * block}")
    # The reduce-scattered GEMM splits its contraction (K of the forward, the kernel's out dim of the dgrad)
    a_slot, kk = ("grad_output", n_out) if column else ("input", k)
    a_q = side(normalize(getattr(qs, a_slot)), ROWWISE)
    br, bc = block_shape(a_q)
    scatter = kk % tp == 0 and (kk // tp) % bc == 0 and (bsz // nb * length) % br == 0
    if not scatter:
        _fallback(f"{a_slot} {qs.role(a_slot) or who}",
                  f"its rowwise copy [{bsz * length}, {kk}] ({a_q.label}, {br}x{bc} blocks) split {tp} ways along "
                  f"its {kk} columns {axes} would cut blocks")
    return SequencePlan(wsh.mesh, batch, axes, (bsz, length), column, bad is None, scatter)

