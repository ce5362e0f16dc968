"""Train states and batches on a device mesh: parameters and optimizer moments placed by their logical axes
(`jaxhq.sharding` rules), everything else replicated, batches split on the batch axis.

Run the steps inside `mesh_context(mesh)` so the layers see the mesh (FSDP weights are gathered as quantized
bytes by the dense op) and the logical-axis rules.
"""
from __future__ import annotations

import contextlib

import jax
import flax.linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from .state import TrainState, _init


def _rules(rules):
    from ..sharding import DEFAULT_RULES
    return DEFAULT_RULES if rules is None else rules


def param_shardings(model, mesh, rules=None):
    """NamedShardings of the model's (unboxed) params, from the logical axes their initialisers declare."""
    from ..sharding import state_shardings
    k = jax.random.key(0)
    boxed = jax.eval_shape(_init, model, k, k)["params"]
    return state_shardings(boxed, mesh, _rules(rules))


def state_shardings(st: TrainState, mesh, rules=None) -> TrainState:
    """A TrainState-shaped tree of shardings: params and param-shaped optimizer moments by logical axes."""
    ps = param_shardings(st.model, mesh, rules)
    pdef = jax.tree.structure(st.params)
    rep = NamedSharding(mesh, PartitionSpec())

    def like_params(sub):
        return jax.tree.structure(sub) == pdef

    opt = jax.tree.map(lambda sub: ps if like_params(sub) else rep, st.opt_state, is_leaf=like_params)
    return st.replace(step=rep, params=ps, opt_state=opt, quant_state=jax.tree.map(lambda _: rep, st.quant_state),
                      weight_amax=jax.tree.map(lambda _: rep, st.weight_amax), key=rep)


def shard_train_state(st: TrainState, mesh, rules=None) -> TrainState:
    """The state placed on `mesh` (see `state_shardings`)."""
    return jax.device_put(st, state_shardings(st, mesh, rules))


def batch_sharding(mesh, rules=None) -> NamedSharding:
    """Tokens [batch, length] split on the batch axis (data, fsdp and expert ranks)."""
    from ..sharding import mesh_axes
    return NamedSharding(mesh, mesh_axes(("batch", "length"), _rules(rules), mesh))


def shard_batch(batch: dict, mesh, rules=None) -> dict:
    return jax.device_put(batch, batch_sharding(mesh, rules))


@contextlib.contextmanager
def mesh_context(mesh, rules=None):
    """`jax.set_mesh(mesh)` and the logical-axis rules, for tracing and running sharded steps."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), nn.logical_axis_rules(_rules(rules)):
        yield
