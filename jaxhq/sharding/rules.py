"""Logical-axis rules: the layers' axis names -> mesh axes, for DP, FSDP, TP, sequence and expert parallelism.

Parameters carry the names embed, mlp, heads, kv, vocab, expert; activations batch, length (and the parameter
names for their feature axes). Rules are Flax's format (`nn.logical_axis_rules`): ordered (logical, mesh axes)
pairs, earlier pairs win, and a mesh axis is used at most once per array. Hence the order below: batch takes
data/fsdp/expert first (so an activation's embed axis stays whole), heads/mlp/vocab take tensor before length
(so length is on tensor only where no feature axis is: the residual stream around norms, sequence parallel).

| logical | mesh | parallelism |
|---|---|---|
| batch | (data, fsdp, expert) | data parallel; FSDP and expert ranks also split the batch |
| expert | expert | expert parallel (GroupedDense kernels [expert, embed, mlp]) |
| heads, mlp | tensor | Megatron: column-parallel qkv/up, row-parallel out/down |
| vocab | tensor | embedding / LM head split on the vocabulary |
| length | tensor if sequence_parallel else unsharded | sequence parallel: the residual stream split on length |
| embed | fsdp | FSDP: weights sharded on their embed axis, gathered for use |
| kv | unsharded | head dim |
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalAxes = Sequence[Union[None, str, Sequence[str]]]


def axis_rules(sequence_parallel: bool = False, fsdp: bool = True) -> tuple:
    """The rules (see the module table). `fsdp=False` keeps weights whole on the fsdp axis (plain ZeRO-less DP)."""
    return (("batch", ("data", "fsdp", "expert")),
            ("expert", "expert"),
            ("heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
            ("length", "tensor" if sequence_parallel else None),
            ("embed", "fsdp" if fsdp else None),
            ("kv", None))


DEFAULT_RULES = axis_rules()


def _flat(names: LogicalAxes):
    """Flatten per-dim names (a dim may be a tuple of logical names, e.g. a fused (heads, kv) axis)."""
    flat, groups = [], []
    for n in names:
        group = tuple(n) if isinstance(n, (tuple, list)) else (n,)
        groups.append(len(group))
        flat.extend(group)
    return flat, groups


def mesh_axes(names: LogicalAxes, rules=None, mesh=None) -> PartitionSpec:
    """PartitionSpec of mesh axes for an array whose dims carry `names` (a dim may fuse several names).

    With `mesh`, mesh axes the rules name but the mesh lacks are dropped (e.g. a mesh of only data and fsdp).
    """
    rules = DEFAULT_RULES if rules is None else rules
    have = None if mesh is None else set(mesh.axis_names)
    flat, groups = _flat(names)
    spec = list(nn.logical_to_mesh_axes(flat, rules))
    out, i = [], 0
    for g in groups:
        axes = []
        for a in spec[i:i + g]:
            axes.extend(() if a is None else (a,) if isinstance(a, str) else tuple(a))
        axes = [a for a in axes if have is None or a in have]
        i += g
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, names: LogicalAxes, rules=None) -> NamedSharding:
    return NamedSharding(mesh, mesh_axes(names, rules, mesh))


def constrain(x, names: LogicalAxes, mesh: Optional[Mesh] = None, rules=None):
    """`with_sharding_constraint` by logical names, with the given or current mesh (`jax.set_mesh`) and rules
    (`nn.logical_axis_rules`, else DEFAULT_RULES); a no-op without a mesh."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        return x
    rules = rules if rules is not None else current_rules()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, mesh_axes(names, rules, mesh)))


def current_mesh():
    """The mesh set by `jax.set_mesh` (or `with mesh:`), or None."""
    m = jax.sharding.get_abstract_mesh()
    return None if m is None or m.empty else m


def current_rules():
    """The rules of an enclosing `nn.logical_axis_rules(...)` block, else DEFAULT_RULES."""
    r = nn.get_logical_axis_rules()
    return tuple(r) if r else DEFAULT_RULES


def logical_specs(state):
    """The logical PartitionSpec of every leaf of a state whose params are boxed by `nn.with_logical_partitioning`
    (optimizer moments built from boxed params are boxed too); unboxed leaves are replicated (P())."""
    return nn.get_partition_spec(state)


def state_shardings(state, mesh: Mesh, rules=None, logical_axes=None):
    """NamedShardings for every leaf: by `logical_axes` (a matching tree of name tuples) or by the boxes."""
    rules = DEFAULT_RULES if rules is None else rules
    if logical_axes is None:
        specs = logical_specs(state)
        return jax.tree.map(lambda s: NamedSharding(mesh, mesh_axes(tuple(s), rules, mesh)), specs,
                            is_leaf=lambda s: isinstance(s, PartitionSpec))
    return jax.tree.map(lambda names: NamedSharding(mesh, mesh_axes(names or (), rules, mesh)), logical_axes,
                        is_leaf=lambda n: isinstance(n, (tuple, PartitionSpec)) or n is None)


def shard_state(state, mesh: Mesh, rules=None, logical_axes=None):
    """Place a train state (params, optimizer moments, quant state) on `mesh` by its logical axes and `rules`.

    Boxed leaves (`nn.Partitioned`) keep their boxes; pass `logical_axes` for an unboxed state.
    """
    shardings = state_shardings(state, mesh, rules, logical_axes)
    return jax.device_put(state, shardings)
