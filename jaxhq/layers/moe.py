"""GroupedDense and MoE: experts as one stacked kernel [E, K, N] run by `jaxhq.ops.grouped_dense`, with a
top-k softmax router and ragged groups in fixed-capacity expert buffers.

Group g's roles are `grouped_linear` roles named "<parent path>.experts_<g>.<module name>" (e.g.
"layers_1.moe.experts_3.fc1"), so a factory can treat each expert on its own. MoE: tokens are routed to their
top-k experts (softmax over all experts, the k weights renormalised), the k copies sorted by expert (stable),
run through fc1 -> activation -> fc2, weighted and scattered back (an unsort). The router is a high-precision
matmul (no role). Delayed-scaling state: quant_state/<path>/experts_<g>/{slot}.

Dispatch "capacity" (default): the tokens are cut into S shards (S: the token shards of the mesh when the
experts are split, else 1); each shard sorts its own copies into buffers [E, C, d] (C = expert_capacity of the
shard's tokens: dropless by default, `capacity_factor` drops what overflows), and expert e's rows are the S
shards' buffers one after another, [E, S*C, d]. Under expert parallelism that concatenation is an all-to-all
(jaxhq/sharding/experts.py): tokens travel only to their experts' rank. With S = 1 and no token dropped the
result equals dispatch "replicated" (one global sort, every expert gets all T*k rows) bit for bit.

Dispatch "grouped": one global sort, and fc1 and fc2 run their forward and dgrad GEMMs as ragged grouped GEMMs over
the T*k sorted rows and their wgrads grouped along those rows (jaxhq.ops.grouped_dense, dispatch "grouped": high
precision or row-local formats, dropless, unsharded experts).
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import ops
from ..formats import QTensor, Storage, init_state, update_state
from ..formats.base import abs_max
from ..ops.activation import activate, is_gated
from ..ops.grouped import DISPATCHES, expert_capacity, from_experts, to_experts
from ..recipes import CustomRecipe
from ..roles import dense_slots
from . import introspect
from .common import check_feature_shapes, make_norm, promote, quant_key
from .dense import default_kernel_init
from .state import QUANT_STATE, SLOTS


def _expert_sharding(kernel_axes, path):
    """The expert-parallel layout of the stacked kernel on the current mesh (None: experts not split)."""
    from ..sharding import expert_sharding
    return expert_sharding(tuple(kernel_axes), path)


def _amax_only(amax) -> QTensor:
    """A stand-in quantized tensor carrying only an amax, to advance a delayed-scaling state."""
    s = Storage(data=None, amax=amax)
    return QTensor(rowwise=s, columnwise=s)


class GroupedDense(nn.Module):
    """y[t] = x[t] @ kernel[g(t)] for x [T, K] sorted by group and `group_sizes` [G]; kernel [G, K, N].
    x [G, C, K] without group_sizes: per-group buffers (see jaxhq.ops.grouped_dense), y [G, C, N]."""

    features: int
    num_groups: int
    recipe: CustomRecipe
    kernel_axes: Tuple[str, str, str] = ("expert", "embed", "mlp")
    param_dtype: Any = jnp.float32
    dtype: Any = None
    kernel_init: Any = default_kernel_init

    def group_path(self, g: int) -> str:
        parts = tuple(str(p) for p in self.scope.path) if self.scope is not None else ()
        own = parts[-1] if parts else "grouped_dense"
        return ".".join(parts[:-1] + (f"experts_{g}", own))

    @nn.compact
    def __call__(self, x, group_sizes=None, *, dispatch: str = "capacity", capacity: Optional[int] = None):
        if x.ndim != (2 if group_sizes is not None else 3):
            raise ValueError(f"GroupedDense {self.group_path(0)!r}: x must be [tokens, features] with group_sizes "
                             f"or [groups, rows, features] without, got {x.shape}")
        init = jax.vmap(lambda k: self.kernel_init(k, (x.shape[-1], self.features), self.param_dtype))
        kernel = self.param("kernel", nn.with_logical_partitioning(
            lambda rng, shape, dtype: init(jax.random.split(rng, shape[0])).astype(dtype), self.kernel_axes),
            (self.num_groups, x.shape[-1], self.features), self.param_dtype)
        x, _ = promote(self.dtype, x, kernel)  # the kernel stays in its param dtype (layers.common.promote_dense)
        qss, svars = [], {}
        for g in range(self.num_groups):
            path = self.group_path(g)
            introspect.record(path, dense_slots(path, module_type="grouped_linear"))
            qs = self.recipe.dense_quantizers(path, "grouped_linear")
            check_feature_shapes(qs, path, x.shape[-2], x.shape[-1], self.features)
            qss.append(qs)
            st = {s: init_state(getattr(qs, s)) for s in SLOTS if getattr(qs, s).stateful}
            if st:
                svars[g] = self.variable(QUANT_STATE, f"experts_{g}", lambda st=st: st)
        states = [svars[g].value if g in svars else None for g in range(self.num_groups)] if svars else None
        y = ops.grouped_dense(x, kernel, group_sizes, quantizers=qss, key=quant_key(self), states=states,
                              expert_sharding=_expert_sharding(self.kernel_axes, self.group_path(0)),
                              dispatch=dispatch, capacity=capacity)
        if svars and not self.is_initializing() and self.is_mutable_collection(QUANT_STATE):
            self._advance_forward_states(x, kernel.astype(x.dtype), group_sizes, qss, svars)
        return y

    def _advance_forward_states(self, x, kernel, group_sizes, qss, svars):
        """The next input/weight states: the amax of each group's own rows and of its kernel."""
        if group_sizes is not None:
            sizes = jnp.asarray(group_sizes, jnp.int32)
            ends = jnp.cumsum(sizes)
            rows = jnp.arange(x.shape[0])
        for g, var in svars.items():
            new = dict(var.value)
            if "input" in new:
                if group_sizes is None:
                    xg = x[g]
                else:
                    xg = jnp.where(((rows >= ends[g] - sizes[g]) & (rows < ends[g]))[:, None], x, 0)
                amax = abs_max(xg).astype(jnp.float32)
                new["input"] = update_state(qss[g].input, new["input"], _amax_only(amax))
            if "weight" in new:
                amax = abs_max(kernel[g]).astype(jnp.float32)
                new["weight"] = update_state(qss[g].weight, new["weight"], _amax_only(amax))
            var.value = new


def route(logits, top_k: int):
    """Top-k routing: (weights [T, k] renormalised softmax probabilities, expert ids [T, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    return w / jnp.sum(w, axis=-1, keepdims=True), idx


def sort_by_expert(idx, num_experts: int):
    """(order of the T*k token copies sorted by expert (stable), token of each sorted copy, group sizes)."""
    flat = idx.reshape(-1)
    tokens = jnp.repeat(jnp.arange(idx.shape[0]), idx.shape[1])
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, tokens[order], sizes


def _unsort(ys, order, tok, w, tokens: int):
    """Each token's output: the sum of its expert outputs (ys, sorted copies [T*k, d]) weighted by the router."""
    ys = ys * w.reshape(-1)[order][:, None].astype(ys.dtype)
    return jnp.zeros((tokens, ys.shape[-1]), ys.dtype).at[tok].add(ys)


def _to_buffers(h, idx, num_experts: int, capacity: int):
    """One token shard's copies sorted by expert into buffers: (rows [E, C, d], live [E, C])."""
    _, tok, sizes = sort_by_expert(idx, num_experts)
    return to_experts(h[tok], sizes, capacity), jnp.arange(capacity)[None, :] < sizes[:, None]


def _from_buffers(ys, idx, w):
    """One token shard's outputs [tokens, d] from its expert buffers ys [E, C, d]."""
    order, tok, sizes = sort_by_expert(idx, ys.shape[0])
    return _unsort(from_experts(ys, sizes, tok.shape[0]), order, tok, w, idx.shape[0])


def _split(a, shards: int):
    return a.reshape(shards, a.shape[0] // shards, *a.shape[1:])


def dispatch_shards(local, shards: int, *args):
    """`local` (a token shard's args -> buffers [E, C, ...]) on each of `shards` token shards, the buffers of
    each expert concatenated in shard order: [E, shards*C, ...] (what the all-to-all of experts.py builds)."""
    if shards == 1:
        return local(*args)
    out = jax.vmap(local)(*(_split(a, shards) for a in args))
    return jax.tree.map(lambda b: jnp.moveaxis(b, 0, 1).reshape(b.shape[1], -1, *b.shape[3:]), out)


def combine_shards(local, shards: int, bufs, *args):
    """The reverse of dispatch_shards: `local(buffers [E, C, ...], *args)` per token shard, concatenated."""
    if shards == 1:
        return local(bufs, *args)
    bufs = jax.tree.map(lambda b: jnp.moveaxis(b.reshape(b.shape[0], shards, -1, *b.shape[2:]), 1, 0), bufs)
    out = jax.vmap(local)(bufs, *(_split(a, shards) for a in args))
    return out.reshape(-1, *out.shape[2:])


class MoE(nn.Module):
    """Mixture of experts (no residual): optional pre-norm, top-k router, experts fc1 -> act -> fc2.

    dispatch: "capacity", "replicated" or "grouped" (see the module docstring). capacity_factor: None (dropless)
    or the expert buffers' rows per token shard over top_k * tokens / num_experts (jaxhq.ops.grouped.expert_capacity;
    "grouped" drops nothing and takes none).
    dispatch_shards: None (the mesh's) or the token shards S of the buffer layout, e.g. to run a layer unsharded
    with a sharded one's layout."""

    num_experts: int
    top_k: int
    d_ff: int
    recipe: CustomRecipe
    activation: str = "swiglu"
    norm: Optional[str] = None
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    dispatch: str = "capacity"
    capacity_factor: Optional[float] = None
    dispatch_shards: Optional[int] = None

    @nn.compact
    def __call__(self, x):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"MoE: dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.dispatch == "grouped" and self.capacity_factor is not None:
            raise ValueError(f"MoE: dispatch 'grouped' drops no tokens; capacity_factor={self.capacity_factor} "
                             "needs dispatch 'capacity'")
        d = x.shape[-1]
        h = make_norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(x) if self.norm else x
        h2 = h.reshape(-1, d)
        router = self.param("router", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None)),
                            (d, self.num_experts), self.param_dtype)
        logits = jnp.dot(h2.astype(jnp.float32), router.astype(jnp.float32))
        w, idx = route(logits, self.top_k)
        width = self.d_ff * (2 if is_gated(self.activation) else 1)
        common = dict(num_groups=self.num_experts, recipe=self.recipe, dtype=self.dtype,
                      param_dtype=self.param_dtype, kernel_init=self.kernel_init)
        fc1 = GroupedDense(width, kernel_axes=("expert", "embed", "mlp"), name="fc1", **common)
        fc2 = GroupedDense(d, kernel_axes=("expert", "mlp", "embed"), name="fc2", **common)
        if self.dispatch in ("replicated", "grouped"):  # the k copies sorted by expert, T * k rows
            order, tok, sizes = sort_by_expert(idx, self.num_experts)
            a = activate(fc1(h2[tok], sizes, dispatch=self.dispatch), self.activation)
            ys = fc2(a, sizes, dispatch=self.dispatch)
            return _unsort(ys, order, tok, w, h2.shape[0]).reshape(x.shape[:-1] + (d,))

        path = ".".join(str(p) for p in self.scope.path) or "moe"
        es = _expert_sharding(("expert", "embed", "mlp"), path)
        shards = self.dispatch_shards or (1 if es is None else es.token_shards)
        if h2.shape[0] % shards:
            raise ValueError(f"MoE {path!r}: {h2.shape[0]} tokens cannot be cut into {shards} token shards")
        cap = expert_capacity(h2.shape[0] // shards, self.num_experts, self.top_k, self.capacity_factor)
        to_buf = functools.partial(_to_buffers, num_experts=self.num_experts, capacity=cap)
        exchange = es is not None and es.exchanges and shards == es.token_shards
        if exchange:
            xs, live = es.dispatch(to_buf, h2, idx)
        else:
            xs, live = dispatch_shards(to_buf, shards, h2, idx)
        a = jnp.where(live[..., None], activate(fc1(xs), self.activation), 0)  # act(0) may not be 0
        ys = fc2(a)
        out = es.combine(_from_buffers, ys, idx, w) if exchange else combine_shards(_from_buffers, shards, ys, idx, w)
        return out.reshape(x.shape[:-1] + (d,))
