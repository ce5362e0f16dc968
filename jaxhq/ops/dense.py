"""The quantized dense op `y = x @ w (+ b)` with a custom VJP whose three GEMMs read their own copies.

forward  y  = rowwise(x)  . rowwise(w)
dgrad    dx = rowwise(dy) . columnwise(w)
wgrad    dw = columnwise(x) . columnwise(dy)

The kernel is in Flax layout [in, out]; it is quantized as w.T ([out, in]) so every GEMM operand is K-major, read
in place (`quantize(kernel, transposed=True)`: no transposed copy of the kernel is made first).
The kernel may be wider than x (the layers pass their float32 master weight): the weight's copies are those of
`kernel.astype(x.dtype)`, and the quantize kernels round each value as they read it, so that cast is not written
and read again (`quantize(..., cast_to=x.dtype)`). The weight's gradient comes out of the wgrad GEMM in x's dtype
and is returned in the kernel's.
The forward saves only the columnwise copies (never x or w in high precision unless their slot is Identity);
where the weight's columnwise copy is its decoded rowwise one read transposed (NVFP4 16x16 blocks on Hopper,
`ops.gemm.shares_transposed_copy`), that is the copy saved; where the backward's GEMMs dequantize, x's copy may
be saved decoded (its quantized values in bf16, `ops.gemm.saved_decoded`).
With `activation`, y = act(x @ w + b) and the backward's grad_output is the gradient of x @ w + b, quantized
from the activation's input (kept from the forward) and dy (jaxhq.ops.activation).
`kernel_amax`: max |kernel| when the caller knows it (the train step computes it with the optimizer update that
writes the kernel): the weight's per-tensor copies (FP8 current scaling, NVFP4 without a Hadamard side) take it,
rounded as the kernel is cast, instead of a reduction over the kernel (rounding is monotone, so the amax of the
cast kernel is the cast amax: the same copies bit for bit).
Delayed-scaling state: the input and weight states are updated by the forward (returned), the grad_output
state through the gradient: the cotangent returned for `states["grad_output"]` is its new value.
Sharding (FSDP): with `weight_sharding` (jaxhq.sharding.WeightSharding) the weight is quantized per shard and
its copies gathered as quantized bytes, the rowwise one for the forward, the columnwise one again in the
backward (the residual stays sharded, as FSDP frees gathered weights); see jaxhq/sharding/gather.py. With
`reshard_after_forward=False` the forward gathers the columnwise copy too and saves it gathered, so the
backward gathers nothing (FSDP2's option: the gather leaves the backward, the gathered copy stays in memory).
Sequence parallelism: when the rules split the activations' length on the tensor axis, a column-parallel op
quantizes its length-split input per shard and gathers the quantized copies, a row-parallel one reduce-scatters
its output onto the length split, and the backward mirrors both; see jaxhq/sharding/sequence.py.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..formats import (COLUMNWISE, NVFP4, ROWWISE, USAGES, Float8CurrentScaling, Float8DelayedScaling, QTensor,
                       quantize, side, update_state)
from ..formats.base import canonical_nan
from ..recipes import DenseQuantizers
from ..sharding.sequence import sequence_plan
from . import activation as act_
from .gemm import decoded_copies, gemm, saved_decoded, shares_transposed_copy

SLOTS = ("input", "weight", "grad_output")


@jax.tree_util.register_static
class _Meta(tuple):
    """Shapes and dtypes the backward needs, kept as static pytree data in the residuals."""


def _check(x, kernel, bias, qs: DenseQuantizers, activation=None, kernel_amax=None):
    where = f" (module {qs.role('input').name})" if qs.roles else ""
    if kernel_amax is not None and jnp.shape(kernel_amax) != ():
        raise ValueError(f"dense{where}: kernel_amax must be a scalar (max |kernel| of the kernel of shape "
                         f"{tuple(kernel.shape)}), got shape {jnp.shape(kernel_amax)}")
    if activation is not None and act_.is_gated(activation) and kernel.shape[-1] % 2:  # is_gated checks the name
        raise ValueError(f"dense{where}: the gated activation {activation!r} halves the {kernel.shape[-1]} outputs "
                         f"of kernel of shape {tuple(kernel.shape)}: an even number is needed")
    if kernel.ndim != 2:
        raise ValueError(f"dense{where}: kernel must be 2D [in, out], got shape {tuple(kernel.shape)}")
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(f"dense{where}: x of shape {tuple(x.shape)} does not match kernel of shape "
                         f"{tuple(kernel.shape)}: x's last axis must equal the kernel's first")
    if bias is not None and bias.shape != (kernel.shape[1],):
        raise ValueError(f"dense{where}: bias of shape {tuple(bias.shape)} does not match {kernel.shape[1]} outputs")


def _keys(key):
    if key is None:
        return None, None, None
    return tuple(jax.random.fold_in(key, i) for i in range(3))


def _quantize(t, qs: DenseQuantizers, slot: str, usage, key, state, transposed=False, cast_to=None, decoded=(),
              amax=None):
    q = getattr(qs, slot)
    try:
        return quantize(t, q, usage, key=key, state=state, transposed=transposed, cast_to=cast_to,
                        decoded=decoded_copies(q, decoded), amax=amax)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{slot} of {qs.role(slot) or 'dense'}: {e}") from None


def takes_kernel_amax(q) -> bool:
    """Whether weight quantizer q's copies read a per-tensor amax that a given kernel_amax can be: FP8 current
    scaling and NVFP4 sides (without a Hadamard-transformed one, whose amax is another), no delayed one."""
    sides = [side(q, a) for a in USAGES]
    return not any(isinstance(s, Float8DelayedScaling) or (isinstance(s, NVFP4) and s.uses_rht(a))
                   for s, a in zip(sides, USAGES)) and any(isinstance(s, (Float8CurrentScaling, NVFP4)) for s in sides)


def _weight_amax(kernel_amax, q, dtype):
    """The weight quantizer's precomputed amax: kernel_amax cast as the kernel is, where q takes one; else None."""
    if kernel_amax is None or not takes_kernel_amax(q):
        return None
    a = jnp.asarray(kernel_amax, jnp.float32)
    if jnp.dtype(dtype) != jnp.float32:  # rounded as the cast rounds: reduce_precision, which XLA keeps (a cast
        fi = jnp.finfo(dtype)              # pair to bfloat16 and back it drops under its default excess precision)
        a = jax.lax.reduce_precision(a, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return canonical_nan(a)


def _new_state(qs, slot, state, qt):
    return None if state is None else update_state(getattr(qs, slot), state, qt)


def _forward(x, kernel, bias, states, key, kernel_amax, qs: DenseQuantizers, usage_x, usage_w, wsh=None, sp=None):
    """(y, new states, the input's and the weight's QTensors); y before any activation."""
    gathered = sp is not None and sp.gathers("input")
    x2d = sp.tokens(x) if gathered else x.reshape(-1, x.shape[-1])
    kx, kw, _ = _keys(key)
    # The copies the forward GEMM reads at once may be written decoded (ops.gemm.decoded_copies), unless they
    # travel first (sharded weights, sequence parallelism: gathered as quantized bytes); in the training forward,
    # so may the backward's copies that it saves (ops.gemm.saved_decoded).
    now = (ROWWISE,) if wsh is None and sp is None else ()
    training = COLUMNWISE in usage_x  # (_dense_fwd asks for the backward's copies of both)

    def to_decode(slot):
        return now + (saved_decoded(getattr(qs, slot), slot, qs.weight) if now and training else ())
    quantize_x = lambda usage, dec=(): _quantize(x2d, qs, "input", usage, kx, states.get("input"),  # noqa: E731
                                                 decoded=dec)
    # sequence parallel: each device quantizes its tokens, the copies are all-gathered as quantized bytes
    qx = sp.quantize(quantize_x, qs.input, usage_x, gather_columnwise=False) if gathered else \
        quantize_x(usage_x, to_decode("input"))
    # Where the weight's two copies hold the same values (NVFP4 16x16 blocks), the dgrad GEMM reads the forward's
    # decoded copy transposed (ops.gemm.shares_transposed_copy): one copy is made, not two.
    share = COLUMNWISE in usage_w and bool(now) and shares_transposed_copy(qs.weight)
    w_amax = _weight_amax(kernel_amax, qs.weight, x.dtype)
    quantize_w = lambda usage, dec: _quantize(kernel, qs, "weight", usage, kw, states.get("weight"),  # noqa: E731
                                              transposed=True, cast_to=x.dtype, decoded=dec, amax=w_amax)
    qw = quantize_w((ROWWISE,), now) if share else quantize_w(usage_w, to_decode("weight"))
    if share:  # (a copy that came back as codes, e.g. on the xla path, cannot be read transposed)
        col = qw.rowwise.transpose_of() if qw.rowwise.decoded else quantize_w((COLUMNWISE,), ()).columnwise
        qw = dataclasses.replace(qw, columnwise=col)
    if wsh is not None:  # sharding hook: keep the quantized copies sharded like the kernel
        qw = wsh.shard(qw)
    w_fwd = qw.rowwise if wsh is None else wsh.gathered(qw.rowwise)  # all-gather of quantized bytes
    fwd = functools.partial(gemm, out_dtype=x.dtype, name="forward", roles=(qs.role("input"), qs.role("weight")),
                            fallback=qs.allow_dequantized_fallback)
    if sp is not None and sp.scatters("forward"):  # row parallel: reduce-scattered onto the length split
        y = sp.scatter_gemm(fwd, qx.rowwise, w_fwd, wsh.storage_spec(ROWWISE, gathered=True))
    else:
        y = fwd(qx.rowwise, w_fwd)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    y = y.reshape(*x.shape[:-1], kernel.shape[1])
    new = {"input": _new_state(qs, "input", states.get("input"), qx),
           "weight": _new_state(qs, "weight", states.get("weight"), qw)}
    return y, new, qx, qw


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _dense(x, kernel, bias, states, key, kernel_amax, qs, wsh, sp, activation):
    y, new, _, _ = _forward(x, kernel, bias, states, key, kernel_amax, qs, (ROWWISE,), (ROWWISE,), wsh, sp)
    return (y if activation is None else act_.activate(y, activation)), new


QUANTIZED_RESIDUAL = "jaxhq_quantized_residual"  # the checkpoint name of the copies the backward GEMMs read


def _dense_fwd(x, kernel, bias, states, key, kernel_amax, qs, wsh, sp, activation=None):
    y, new, qx, qw = _forward(x, kernel, bias, states, key, kernel_amax, qs, (ROWWISE, COLUMNWISE),
                              (ROWWISE, COLUMNWISE), wsh, sp)
    h = None  # with an activation: its input, for the backward (as JAX keeps it for an activation's derivative)
    if activation is not None:
        h, y = y, act_.activate(y, activation)
    saved_x = QTensor(columnwise=qx.columnwise, shape=qx.shape, dtype=qx.dtype)
    w_col = qw.columnwise  # saved sharded like the kernel (FSDP frees the gathered copy) ...
    if wsh is not None and not wsh.reshard_after_forward:
        w_col = wsh.gathered(w_col)  # ... or gathered now and kept for the backward
    saved_w = QTensor(columnwise=w_col, shape=qw.shape, dtype=qw.dtype)
    # Named so that a remat policy can keep exactly these (the quantized copies) and recompute the rest.
    saved_x, saved_w = jax.tree.map(lambda v: checkpoint_name(v, QUANTIZED_RESIDUAL), (saved_x, saved_w))
    meta = _Meta((x.shape, x.dtype, kernel.dtype, None if bias is None else bias.dtype))
    return (y, new), (saved_x, saved_w, h, states, key, meta)


def _dense_bwd(qs, wsh, sp, activation, res, cts):
    saved_x, saved_w, h, states_in, key, (x_shape, x_dtype, k_dtype, b_dtype) = res
    dy_state = states_in.get("grad_output")
    dy = cts[0]
    gathered = sp is not None and sp.gathers("grad_output")
    # With an activation, the GEMM output's gradient is quantized from h and dy where a kernel takes them, unless it
    # is needed itself (the bias) or the op is sharded (its copies then travel or are made per shard).
    if activation is not None and b_dtype is None and wsh is None and sp is None:
        dy2d = act_.input_grad(h.reshape(-1, h.shape[-1]), dy.reshape(-1, dy.shape[-1]), activation)
    else:
        if activation is not None:
            dy = act_.input_grad(h, dy, activation).grad()
        dy2d = sp.tokens(dy) if gathered else dy.reshape(-1, dy.shape[-1])
    _, _, kdy = _keys(key)
    both = (ROWWISE, COLUMNWISE)
    now = both if wsh is None and sp is None else ()  # both GEMMs read the gradient's copies at once
    quantize_dy = lambda usage, dec=(): _quantize(dy2d, qs, "grad_output", usage, kdy, dy_state,  # noqa: E731
                                                  decoded=dec)
    qdy = sp.quantize(quantize_dy, qs.grad_output, both) if gathered else quantize_dy(both, now)
    w_col = saved_w.columnwise
    if wsh is not None and wsh.reshard_after_forward:
        w_col = wsh.gathered(w_col)  # the residual was saved sharded: re-gathered
    dgrad = functools.partial(gemm, out_dtype=x_dtype, name="dgrad", roles=(qs.role("grad_output"), qs.role("weight")),
                              fallback=qs.allow_dequantized_fallback)
    if sp is not None and sp.scatters("dgrad"):  # column parallel: reduce-scattered onto the length split
        dx = sp.scatter_gemm(dgrad, qdy.rowwise, w_col, wsh.storage_spec(COLUMNWISE, gathered=True))
    else:
        dx = dgrad(qdy.rowwise, w_col)
    x_col = saved_x.columnwise
    if sp is not None and sp.gathers("input"):
        x_col = sp.columnwise(x_col, qs.input)  # the residual, gathered
    wgrad = functools.partial(gemm, out_dtype=x_dtype, name="wgrad", roles=(qs.role("input"), qs.role("grad_output")),
                              fallback=qs.allow_dequantized_fallback)
    if wsh is None:
        dw = wgrad(x_col, qdy.columnwise)
    else:  # per-device partial GEMM over local tokens, reduce-scattered into the kernel's layout
        dw = wsh.wgrad(wgrad, x_col, qdy.columnwise)
    db = None if b_dtype is None else jnp.sum(dy2d.astype(jnp.float32), axis=0).astype(b_dtype)
    # "The gradient is the new state": the cotangent of the grad_output state is its next value.
    d_states = {k: jax.tree.map(jnp.zeros_like, v) for k, v in states_in.items()}
    if "grad_output" in d_states:
        d_states["grad_output"] = _new_state(qs, "grad_output", dy_state, qdy)
    return dx.reshape(x_shape), dw.astype(k_dtype), db, d_states, None, None


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x, kernel, bias=None, *, quantizers: DenseQuantizers, states: Optional[dict] = None, key=None,
          return_state: bool = False, weight_sharding=None, activation: Optional[str] = None, kernel_amax=None):
    """Quantized `x @ kernel + bias` for x of any rank (leading dims are tokens), output in x's dtype.

    quantizers: one per slot (input, weight, grad_output). states: {slot: delayed-scaling state} for the
    stateful slots. key: jax.random key for stochastic rounding. With return_state, returns
    (y, {"input": .., "weight": ..}) where the forward-slot states are the next ones. weight_sharding: a
    jaxhq.sharding.WeightSharding (or None) for a kernel sharded on a mesh, see jaxhq.sharding.weight_sharding.
    activation: a name of jaxhq.ops.activation.ACTIVATIONS applied to the result (gated: to its halves, so the
    result has half the kernel's outputs). Without a bias or sharding, the backward quantizes the GEMM output's
    gradient from the activation's input and its output's gradient (ops.activation): where a kernel takes them,
    that gradient is never written. kernel_amax: max |kernel| (a float32 scalar) where the caller knows it, for
    the weight's per-tensor copies (see the module docstring); it must be the amax of this kernel.
    """
    _check(x, kernel, bias, quantizers, activation, kernel_amax)
    if weight_sharding is not None:  # trace-time: no quantization block may straddle two shards
        weight_sharding.check(quantizers.weight, kernel.shape, role=quantizers.role("weight"))
    plan = sequence_plan(weight_sharding, x.shape, quantizers, kernel.shape[1])
    states = dict(states or {})
    y, new = _dense(x, kernel, bias, states, key, kernel_amax, quantizers, weight_sharding, plan, activation)
    return (y, new) if return_state else y
