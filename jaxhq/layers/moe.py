"""GroupedDense and MoE: experts as one stacked kernel [E, K, N] run by `jaxhq.ops.grouped_dense`, with a
top-k softmax router and dropless ragged groups.

Group g's roles are `grouped_linear` roles named "<parent path>.experts_<g>.<module name>" (e.g.
"layers_1.moe.experts_3.fc1"), so a factory can treat each expert on its own. MoE: tokens are routed to their
top-k experts (softmax over all experts, the k weights renormalised), the k copies sorted by expert (stable),
run through fc1 -> activation -> fc2 as ragged groups, weighted and scattered back (an unsort). The router
is a high-precision matmul (no role). Delayed-scaling state: quant_state/<path>/experts_<g>/{slot}.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import ops
from ..formats import QTensor, Storage, init_state, update_state
from ..formats.base import abs_max
from ..recipes import CustomRecipe
from ..roles import dense_slots
from . import introspect
from .common import check_feature_shapes, make_norm, promote, quant_key
from .dense import default_kernel_init
from .mlp import activate, is_gated
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
    """y[t] = x[t] @ kernel[g(t)] for x [T, K] sorted by group and `group_sizes` [G]; kernel [G, K, N]."""

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
    def __call__(self, x, group_sizes):
        if x.ndim != 2:
            raise ValueError(f"GroupedDense {self.group_path(0)!r}: x must be [tokens, features], got {x.shape}")
        init = jax.vmap(lambda k: self.kernel_init(k, (x.shape[-1], self.features), self.param_dtype))
        kernel = self.param("kernel", nn.with_logical_partitioning(
            lambda rng, shape, dtype: init(jax.random.split(rng, shape[0])).astype(dtype), self.kernel_axes),
            (self.num_groups, x.shape[-1], self.features), self.param_dtype)
        x, kernel = promote(self.dtype, x, kernel)
        qss, svars = [], {}
        for g in range(self.num_groups):
            path = self.group_path(g)
            introspect.record(path, dense_slots(path, module_type="grouped_linear"))
            qs = self.recipe.dense_quantizers(path, "grouped_linear")
            check_feature_shapes(qs, path, x.shape[0], x.shape[1], self.features)
            qss.append(qs)
            st = {s: init_state(getattr(qs, s)) for s in SLOTS if getattr(qs, s).stateful}
            if st:
                svars[g] = self.variable(QUANT_STATE, f"experts_{g}", lambda st=st: st)
        states = [svars[g].value if g in svars else None for g in range(self.num_groups)] if svars else None
        y = ops.grouped_dense(x, kernel, group_sizes, quantizers=qss, key=quant_key(self), states=states,
                              expert_sharding=_expert_sharding(self.kernel_axes, self.group_path(0)))
        if svars and not self.is_initializing() and self.is_mutable_collection(QUANT_STATE):
            self._advance_forward_states(x, kernel, group_sizes, qss, svars)
        return y

    def _advance_forward_states(self, x, kernel, group_sizes, qss, svars):
        """The next input/weight states: the amax of each group's own rows and of its kernel."""
        sizes = jnp.asarray(group_sizes, jnp.int32)
        ends = jnp.cumsum(sizes)
        rows = jnp.arange(x.shape[0])
        for g, var in svars.items():
            new = dict(var.value)
            in_group = ((rows >= ends[g] - sizes[g]) & (rows < ends[g]))[:, None]
            if "input" in new:
                amax = abs_max(jnp.where(in_group, x, 0)).astype(jnp.float32)
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


class MoE(nn.Module):
    """Mixture of experts (no residual): optional pre-norm, top-k router, experts fc1 -> act -> fc2."""

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

    @nn.compact
    def __call__(self, x):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        d = x.shape[-1]
        h = make_norm(self.norm, self.epsilon, self.dtype, self.param_dtype)(x) if self.norm else x
        h2 = h.reshape(-1, d)
        router = self.param("router", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None)),
                            (d, self.num_experts), self.param_dtype)
        logits = jnp.dot(h2.astype(jnp.float32), router.astype(jnp.float32))
        w, idx = route(logits, self.top_k)
        order, tok, sizes = sort_by_expert(idx, self.num_experts)
        xs = h2[tok]
        width = self.d_ff * (2 if is_gated(self.activation) else 1)
        common = dict(num_groups=self.num_experts, recipe=self.recipe, dtype=self.dtype,
                      param_dtype=self.param_dtype, kernel_init=self.kernel_init)
        a = GroupedDense(width, kernel_axes=("expert", "embed", "mlp"), name="fc1", **common)(xs, sizes)
        a = activate(a, self.activation)
        ys = GroupedDense(d, kernel_axes=("expert", "mlp", "embed"), name="fc2", **common)(a, sizes)
        ys = ys * w.reshape(-1)[order][:, None].astype(ys.dtype)
        out = jnp.zeros((h2.shape[0], d), ys.dtype).at[tok].add(ys)
        return out.reshape(x.shape[:-1] + (d,))
