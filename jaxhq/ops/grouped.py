"""Grouped dense for MoE: tokens sorted by expert, ragged group sizes, one kernel and one set of slots per group.

Each group runs the dense op on its own rows starting at row 0 with zero rows after them, so per-tensor
amaxes, blocks along the token axis (the columnwise copies) and gradients see exactly that group's tokens, as
if the group were quantized alone. Two dispatches build those per-group rows: "capacity" (the default) copies
group g's rows into a fixed buffer xs[g] of `capacity` rows (a multiple of 128, so token-axis blocks of every
format stay whole; rows past the capacity are dropped, their output 0), "replicated" rolls the whole [T, K]
input per group (every group, hence every expert rank, gets all T rows). With capacity >= the largest group
both give the same bits (NVFP4 stochastic rounding aside: its random draws depend on the buffer's length, so
its wgrad matches bit for bit only when capacity == T). Groups may use different quantizers (some hybrid, some not). When every group has
the same quantizers (roles aside) and the kernels are one stacked array, the groups run as one vmap over the
experts; with an ExpertSharding that vmap is split on the expert mesh axis (expert parallelism, see
jaxhq/sharding/experts.py). This is the exact reference.

"grouped" runs the forward and dgrad GEMMs as one ragged grouped GEMM each over the sorted rows
(jaxhq.ffi.gemm.grouped_gemm: no per-group buffers, no multiply of rows past a group; on a Hopper with CUTLASS
the blockwise FP8, dequantized MXFP8 and bf16 calls read the group sizes on the device, and the MXFP8 copies those
GEMMs read at once come decoded, as the dense op's do, so no call dequantizes the G weights; high-precision
operands without a kernel take XLA's ragged_dot), for quantizers whose forward and dgrad copies are high precision or
row-local (rowwise MXFP8 or 1x128 blocks), so that quantizing all rows at once gives each row the bits its group
alone would give it. The wgrad contracts over each group's rows. Where the columnwise copies are high precision
or block-local along the tokens too (MXFP8, 1x128 blocks), the sorted rows are laid out in segments of whole
128-row blocks (`to_segments`: no block mixes two groups), each operand is quantized once, and one GEMM grouped
along the tokens multiplies each group's segment only (jaxhq.ffi.gemm.segment_gemm on a Hopper: 1x128 FP8, or
bf16 values: MXFP8's decoded copies, high-precision ones; for float32 outputs and elsewhere one GEMM per group
with the other segments' tokens zeroed). Other columnwise copies (per-tensor scales, stochastic rounding) come
from dropless capacity buffers as above, with the capacity dispatch's keys. It needs one stacked kernel, the same
quantizers for every group, no delayed-scaling state and no expert sharding; otherwise it says which.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from ..formats import COLUMNWISE, MXFP8, ROWWISE, Float8Block, Identity, side
from ..recipes import DenseQuantizers
from .dense import _keys, _Meta, _quantize, dense
from .gemm import gemm

ROW_BLOCK = 128  # capacities are multiples of this: it is a multiple of every format's block along tokens
DISPATCHES = ("capacity", "replicated", "grouped")


def round_rows(n: int) -> int:
    """n rounded up to a whole number of ROW_BLOCK rows (at least one block)."""
    return max(1, -(-int(n) // ROW_BLOCK)) * ROW_BLOCK


def expert_capacity(tokens: int, num_experts: int, top_k: int = 1, capacity_factor: Optional[float] = None) -> int:
    """Rows per expert buffer for `tokens` tokens routed to `top_k` of `num_experts` experts each.

    None: round_rows(tokens), enough for any routing (a token picks an expert at most once), nothing dropped.
    capacity_factor f: round_rows(ceil(f * tokens * top_k / num_experts)); an expert picked by more tokens
    drops the last ones in sorted order (their output rows are 0)."""
    if capacity_factor is None:
        return round_rows(tokens)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return round_rows(math.ceil(capacity_factor * tokens * top_k / num_experts))


def _starts(group_sizes):
    sizes = jnp.asarray(group_sizes, jnp.int32)
    return sizes, jnp.cumsum(sizes) - sizes


def to_experts(x, group_sizes, capacity: int):
    """x [T, K] sorted by group -> xs [G, capacity, K]: row i of group g at xs[g, i], zeros past the group,
    rows past the capacity dropped."""
    sizes, starts = _starts(group_sizes)
    i = jnp.arange(capacity)
    src = jnp.clip(starts[:, None] + i, 0, x.shape[0] - 1)
    keep = (i < sizes[:, None])[..., None]
    return jnp.where(keep, x[src], jnp.zeros((), x.dtype))


def group_of_rows(group_sizes, rows: int):
    """The group of each of `rows` sorted rows (the last group for rows past all of them)."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    return jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right"), 0, sizes.shape[0] - 1)


def to_segments(x, group_sizes):
    """x [T, K] sorted by group -> (xp [P, K], segment sizes [G]): group g's rows from the start of its segment,
    each segment the group's size (clamped to the rows there are) rounded up to whole ROW_BLOCK-row blocks, zeros
    after its rows and past the last segment; P = round_rows(T + G * (ROW_BLOCK - 1)) holds any sizes."""
    rows, num = x.shape[0], jnp.shape(group_sizes)[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)), rows)
    sizes = jnp.diff(ends, prepend=0)
    seg, seg_starts = _starts(-(-sizes // ROW_BLOCK) * ROW_BLOCK)
    r = jnp.arange(round_rows(rows + num * (ROW_BLOCK - 1)))
    g = group_of_rows(seg, r.shape[0])
    pos = r - seg_starts[g]
    src = jnp.clip(ends[g] - sizes[g] + pos, 0, rows - 1)
    return jnp.where((pos < sizes[g])[:, None], x[src], jnp.zeros((), x.dtype)), seg


def from_experts(ys, group_sizes, rows: int):
    """The inverse of to_experts: ys [G, C, N] -> y [rows, N] sorted by group; dropped rows and rows past the
    last group are 0."""
    sizes, starts = _starts(group_sizes)
    g = group_of_rows(sizes, rows)
    pos = jnp.arange(rows) - starts[g]
    keep = ((pos < sizes[g]) & (pos < ys.shape[1]))[:, None]
    return jnp.where(keep, ys[g, jnp.clip(pos, 0, ys.shape[1] - 1)], jnp.zeros((), ys.dtype))


def _shared(quantizers: Sequence[DenseQuantizers]):
    """The quantizers every group shares (the first group's, with its roles for error messages), or None."""
    plain = {dataclasses.replace(q, roles=None) for q in quantizers}
    return quantizers[0] if len(plain) == 1 else None


def grouped_dense(x, kernels, group_sizes=None, *, quantizers: Sequence[DenseQuantizers], biases=None, key=None,
                  states: Sequence = None, expert_sharding=None, dispatch: str = "capacity",
                  capacity: Optional[int] = None):
    """y[t] = x[t] @ kernels[g(t)] (+ biases[g(t)]) for x [T, K] sorted by group, kernels [G, K, N] (or a list
    of G kernels), group_sizes [G] summing to at most T (rows past the last group give zeros).

    x [G, C, K] with group_sizes None: rows already in per-group buffers (zeros past each group's rows, as
    to_experts makes them); returns [G, C, N]. dispatch: "capacity" (default; capacity None: round_rows(T),
    exact), "replicated" (the former dispatch: every group gets all T rows) or "grouped" (ragged grouped GEMMs
    over the sorted rows, for row-local formats; capacity must be None), see the module docstring.
    expert_sharding: a jaxhq.sharding.ExpertSharding (or None) for kernels split on an expert mesh axis; the
    experts are split when the kernels are one stacked array and every group has the same quantizers (else
    they run one by one, with a warning).
    """
    num = len(kernels)
    if len(quantizers) != num:
        raise ValueError(f"grouped_dense: {num} kernels but {len(quantizers)} quantizer sets")
    if dispatch not in DISPATCHES:
        raise ValueError(f"grouped_dense: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if x.ndim == 3 and group_sizes is None:
        if x.shape[0] != num:
            raise ValueError(f"grouped_dense: x of shape {tuple(x.shape)} holds {x.shape[0]} groups, not {num}")
        return _experts(x, kernels, quantizers, biases, key, states, expert_sharding)
    if x.ndim != 2:
        raise ValueError(f"grouped_dense: x must be [tokens, features] (or [groups, rows, features] without "
                         f"group_sizes), got shape {tuple(x.shape)}")
    rows = x.shape[0]
    if dispatch == "grouped":
        return _grouped_gemms(x, kernels, group_sizes, quantizers, biases, key, states, expert_sharding, capacity)
    if dispatch == "capacity":
        xs = to_experts(x, group_sizes, round_rows(rows) if capacity is None else capacity)
        return from_experts(_experts(xs, kernels, quantizers, biases, key, states, expert_sharding),
                            group_sizes, rows)
    sizes, starts = _starts(group_sizes)
    live = jnp.arange(rows)[None, :] < sizes[:, None]  # [G, T]: group g's rows once rolled to row 0

    def take(g):  # group g's rows rolled to row 0, the others zero
        return jnp.roll(x, -starts[g], axis=0) * live[g][:, None].astype(x.dtype)

    def put(yg, g):  # back to group g's rows, zero elsewhere
        return jnp.roll(yg * live[g][:, None].astype(yg.dtype), starts[g], axis=0)

    gs = jnp.arange(num)
    ys = _experts(jax.vmap(take)(gs), kernels, quantizers, biases, key, states, expert_sharding)
    return jnp.sum(jax.vmap(put)(ys, gs), axis=0)


def _experts(xs, kernels, quantizers, biases, key, states, expert_sharding):
    """ys[g] = dense(xs[g], kernels[g]) for per-group rows xs [G, R, K]: one vmap over the experts (split on
    the expert mesh axis with an ExpertSharding) when they share quantizers, else a loop."""
    num = len(kernels)

    def group_key(g):
        return None if key is None else jax.random.fold_in(key, g)

    shared = _shared(quantizers) if not isinstance(kernels, (list, tuple)) else None
    if expert_sharding is not None:
        expert_sharding.check(num)
        if shared is None:
            who = quantizers[0].role("weight") if quantizers[0].roles else "grouped dense"
            warnings.warn(f"{who}: the experts have different quantizers (or the kernels are not one stacked "
                          "array), so they run one by one and XLA moves each expert's kernel, unquantized, to "
                          "every device; give the experts of one layer the same formats for expert parallelism",
                          stacklevel=3)
    if shared is None:
        return jnp.stack([dense(xs[g], kernels[g], None if biases is None else biases[g], quantizers=quantizers[g],
                                states=None if states is None else states[g], key=group_key(g))
                          for g in range(num)])

    gs = jnp.arange(num)
    ws, axis = None, None
    if expert_sharding is not None:
        xs = expert_sharding.constrain_groups(xs)
        ws, axis = expert_sharding.kernel, expert_sharding.spmd_axis_name
    stacked = None if states is None else jax.tree.map(lambda *s: jnp.stack(s), *states)
    keys = None if key is None else jax.vmap(group_key)(gs)

    def one(xg, kg, bg, key_g, st):
        return dense(xg, kg, bg, quantizers=shared, states=st, key=key_g, weight_sharding=ws)

    return jax.vmap(one, in_axes=(0, 0, None if biases is None else 0, None if keys is None else 0,
                                  None if stacked is None else 0), spmd_axis_name=axis)(
        xs, kernels, biases, keys, stacked)


def _row_local(q, axis: str) -> bool:
    """Whether q's `axis` copy of a [rows, K] tensor gives each row the bits it gets quantized alone: high
    precision, or blocks along K only (MXFP8, 1x128) and no per-tensor scale."""
    s = side(q, axis)
    return isinstance(s, (Identity, MXFP8)) or (isinstance(s, Float8Block) and s.block[0] == 1)


def _grouped_unfit(x, kernels, quantizers, states, expert_sharding, capacity) -> str:
    """Why dispatch "grouped" cannot run this call ("" when it can)."""
    shared = _shared(quantizers) if not isinstance(kernels, (list, tuple)) else None
    if shared is None:
        return "the groups need one stacked kernel [G, K, N] and the same quantizers"
    if states is not None or any(getattr(shared, s).stateful for s in ("input", "weight", "grad_output")):
        return "delayed-scaling state is kept per group; use dispatch 'capacity'"
    if expert_sharding is not None:
        return "the experts are split over a mesh axis; use dispatch 'capacity'"
    if capacity is not None:
        return f"it drops no rows (capacity {capacity} given)"
    for slot in ("input", "grad_output"):
        if not _row_local(getattr(shared, slot), ROWWISE):
            q = side(getattr(shared, slot), ROWWISE)
            return (f"the {slot}'s rowwise copy ({q.label}, of {shared.role(slot) or slot}) is not row-local (high "
                    "precision, MXFP8 or 1x128 FP8 blocks), so one quantization of all rows would not give each "
                    "group's rows their own bits")
    return ""


def _grouped_gemms(x, kernels, group_sizes, quantizers, biases, key, states, expert_sharding, capacity):
    why = _grouped_unfit(x, kernels, quantizers, states, expert_sharding, capacity)
    if why:
        who = quantizers[0].role("weight") if quantizers[0].roles else "grouped dense"
        raise ValueError(f"{who}: dispatch 'grouped' (x {tuple(x.shape)}, kernels {tuple(kernels.shape)}): {why}")
    sizes = jnp.asarray(group_sizes, jnp.int32).reshape(kernels.shape[0])
    keys = None if key is None else jax.vmap(lambda g: jax.random.fold_in(key, g))(jnp.arange(kernels.shape[0]))
    return _grouped_gemm_op(x, kernels, biases, sizes, keys, _shared(quantizers))


def _quantized_weights(kernels, keys, qs, dtype, usage, decoded=()):
    """Each group's kernel [K, N] quantized as the dense op quantizes it (as kernel.T, the copies in `usage`, the
    group's weight key; `decoded`: as the dense op's `_quantize`), stacked."""
    def one(k, kg):
        return _quantize(k, qs, "weight", usage, _keys(kg)[1], None, transposed=True, cast_to=dtype, decoded=decoded)
    return jax.vmap(one, in_axes=(0, None if keys is None else 0))(kernels, keys)


def _grouped_call(a, bs, sizes, dtype, qs, name: str, slot: str):
    """The grouped GEMM; for two high-precision operands without a kernel (CPU, float32) XLA's ragged_dot."""
    from ..ffi.gemm import GemmUnsupported, grouped_gemm
    try:
        return grouped_gemm(a, bs, sizes, dtype)
    except GemmUnsupported as e:
        if a.quantizer.name == bs.quantizer.name == "identity":
            return jax.lax.ragged_dot(a.data, jnp.swapaxes(bs.data, 1, 2), sizes,
                                      preferred_element_type=jnp.float32).astype(dtype)
        raise ValueError(f"{name} of {qs.role(slot) or 'grouped dense'} (dispatch 'grouped'): {e}") from None


def _grouped_forward(x, kernels, biases, sizes, keys, qs, usage_w):
    """(y, the weights' QTensor with the copies in usage_w). The rowwise copies, which the GEMM reads at once, are
    written decoded where the grouped GEMM would dequantize them (ops.gemm.decoded_copies, as the dense op's);
    the weights' columnwise copies, kept for dgrad, stay codes."""
    qx = _quantize(x, qs, "input", (ROWWISE,), None, None, decoded=(ROWWISE,))
    qw = _quantized_weights(kernels, keys, qs, x.dtype, usage_w, decoded=(ROWWISE,))
    y = _grouped_call(qx.rowwise, qw.rowwise, sizes, x.dtype, qs, "forward", "input")
    if biases is not None:  # per row its group's bias; rows past the groups stay 0
        live = jnp.arange(x.shape[0]) < jnp.sum(sizes)
        y = y + jnp.where(live[:, None], biases[group_of_rows(sizes, x.shape[0])].astype(y.dtype),
                          jnp.zeros((), y.dtype))
    return y, qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_gemm_op(x, kernels, biases, sizes, keys, qs):
    return _grouped_forward(x, kernels, biases, sizes, keys, qs, (ROWWISE,))[0]  # no backward: no dgrad copy


def _grouped_fwd(x, kernels, biases, sizes, keys, qs):
    y, qw = _grouped_forward(x, kernels, biases, sizes, keys, qs, (ROWWISE, COLUMNWISE))
    return y, (x, qw.columnwise, sizes, keys, _Meta((kernels.dtype, None if biases is None else biases.dtype)))


def _grouped_bwd(qs, res, dy):
    x, w_col, sizes, keys, (k_dtype, b_dtype) = res
    qdy = _quantize(dy, qs, "grad_output", (ROWWISE,), None, None, decoded=(ROWWISE,))
    dx = _grouped_call(qdy.rowwise, w_col, sizes, x.dtype, qs, "dgrad", "grad_output")
    if _row_local(qs.input, COLUMNWISE) and _row_local(qs.grad_output, COLUMNWISE):
        dw = _segment_wgrad(x, dy, sizes, qs).astype(k_dtype)
        live = (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]
        db = None if b_dtype is None else jax.ops.segment_sum(
            jnp.where(live, dy.astype(jnp.float32), 0.0), group_of_rows(sizes, x.shape[0]),
            num_segments=sizes.shape[0]).astype(b_dtype)
        return dx, dw, db, None, None
    # wgrad: each group's rows in a dropless buffer, its columnwise copies per group, as the dense op makes them
    cap = round_rows(x.shape[0])
    xs, dys = to_experts(x, sizes, cap), to_experts(dy, sizes, cap)

    def wgrad(xg, dyg, kg):  # kg: the group's key, split per slot as the dense op splits it
        kx, _, kdy = _keys(kg)
        qxg = _quantize(xg, qs, "input", (COLUMNWISE,), kx, None)
        qdyg = _quantize(dyg, qs, "grad_output", (COLUMNWISE,), kdy, None)
        return gemm(qxg.columnwise, qdyg.columnwise, out_dtype=x.dtype, name="wgrad",
                    roles=(qs.role("input"), qs.role("grad_output")), fallback=qs.allow_dequantized_fallback)

    dw = jax.vmap(wgrad, in_axes=(0, 0, None if keys is None else 0))(xs, dys, keys).astype(k_dtype)
    db = None if b_dtype is None else jnp.sum(dys.astype(jnp.float32), axis=1).astype(b_dtype)
    return dx, dw, db, None, None


def _segment_wgrad(x, dy, sizes, qs):
    """dw[g] = x_g.T @ dy_g over each group's rows, from one quantization of the segment-laid-out x and dy (their
    columnwise copies are block-local along the tokens, so each group's blocks hold its rows alone, as in its
    dropless buffer): one GEMM grouped along the tokens where a kernel takes the pair, else per group the GEMM of
    the copies with the other segments' columns zeroed."""
    from ..ffi.gemm import GemmUnsupported, segment_gemm
    xp, seg = to_segments(x, sizes)
    dyp, _ = to_segments(dy, sizes)
    # decoded where the GEMMs dequantize (MXFP8 on a Hopper): the bf16 segment kernel (or the masked GEMMs) reads
    # their values
    a = _quantize(xp, qs, "input", (COLUMNWISE,), None, None, decoded=(COLUMNWISE,)).columnwise
    b = _quantize(dyp, qs, "grad_output", (COLUMNWISE,), None, None, decoded=(COLUMNWISE,)).columnwise
    try:
        return segment_gemm(a, b, seg, x.dtype)
    except GemmUnsupported:
        pass
    ends = jnp.cumsum(seg)
    cols = jnp.arange(a.data.shape[1])

    def one(start, end):  # A with the columns (tokens) outside [start, end) zeroed: those products add 0
        keep = ((cols >= start) & (cols < end))[None, :]
        am = dataclasses.replace(a, data=jnp.where(keep, a.data, jnp.zeros((), a.data.dtype)))
        return gemm(am, b, out_dtype=x.dtype, name="wgrad", roles=(qs.role("input"), qs.role("grad_output")),
                    fallback=qs.allow_dequantized_fallback)

    return jax.vmap(one)(ends - seg, ends)


_grouped_gemm_op.defvjp(_grouped_fwd, _grouped_bwd)
