"""Expert parallelism: stacked expert kernels [E, K, N] split on the `expert` mesh axis.

The grouped dense op runs its groups as one vmap over the experts whose `spmd_axis_name` is the mesh axis of
the expert dim, so each device computes only the experts it holds and no expert kernel moves between expert
ranks. Inside an expert, the kernel [K, N] is laid out like any dense kernel (`kernel`, a WeightSharding:
FSDP shards gathered as quantized bytes, tensor-parallel splits kept), and each group's token rows are split
on the remaining batch axes (`tokens`: data, fsdp), as in a dense layer.

Token dispatch (MoE): when the tokens are split on the expert axis too (the default rules' batch is (data,
fsdp, expert)), `dispatch` builds each token shard's per-expert buffers [E, C, ...] where the tokens lie and an
all-to-all over the expert axis sends each expert's rows to its rank, [E/P, P*C, ...] there; `combine` is the
reverse all-to-all. Each expert rank receives only its experts' rows, never every token.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .gather import ShardingError, WeightSharding, _axes, _reshard_after_forward, mesh_ways
from .rules import LogicalAxes, current_mesh, current_rules, mesh_axes


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """Where the experts of a grouped dense live: `axes` (mesh axes of the expert dim), `kernel` (the layout
    of one expert's kernel [K, N], FSDP gathers included) and `tokens` (mesh axes of a group's token rows).
    `name` labels errors."""

    mesh: Any
    axes: tuple
    kernel: WeightSharding
    tokens: tuple = ()
    name: str = ""
    batch: tuple = ()  # mesh axes (size > 1) the tokens are split on outside the experts, in the rules' order

    @property
    def ways(self) -> int:
        return mesh_ways(self.mesh, self.axes)

    @property
    def spmd_axis_name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def check(self, num_experts: int) -> None:
        """Raise ShardingError when the experts cannot be split evenly over the expert axes."""
        if num_experts % self.ways:
            raise ShardingError(
                f"grouped dense {self.name or '(unnamed)'}: {num_experts} experts cannot be split over the mesh "
                f"axes {self.axes} ({self.ways} devices); use a multiple of {self.ways} experts or a smaller "
                "expert axis")

    def constrain_groups(self, xs):
        """xs [E, T, K] (one row set per expert): experts on the expert axes, token rows on `tokens`."""
        spec = PartitionSpec(self.spmd_axis_name, self.tokens or None, *([None] * (xs.ndim - 2)))
        return jax.lax.with_sharding_constraint(xs, NamedSharding(self.mesh, spec))


    @property
    def token_shards(self) -> int:
        """How many pieces the tokens are split into outside the experts (over the `batch` axes)."""
        return mesh_ways(self.mesh, self.batch)

    @property
    def exchanges(self) -> bool:
        """Whether tokens reach their experts by all-to-all: the expert axes are the innermost batch axes, so
        the buffers that arrive are the experts' rows in token-shard order (see `dispatch`)."""
        return bool(self.batch) and self.batch[-len(self.axes):] == self.axes

    def _specs(self):
        return PartitionSpec(self.batch), PartitionSpec(self.spmd_axis_name, self.tokens or None)

    def dispatch(self, local, *args):
        """Per-expert buffers of sharded tokens: `local` maps a token shard's args (split on their first dim)
        to buffers [E, C, ...]; the all-to-all returns the global [E, token_shards * C, ...], experts on the
        expert axes and rows on `tokens`, laid out as jaxhq.layers.moe's unsharded dispatch of as many shards."""
        tok, grp = self._specs()
        a2a = functools.partial(jax.lax.all_to_all, axis_name=self.spmd_axis_name, split_axis=0, concat_axis=1,
                                tiled=True)
        body = lambda *a: jax.tree.map(a2a, local(*a))  # noqa: E731
        return jax.shard_map(body, mesh=self.mesh, in_specs=(tok,) * len(args), out_specs=grp,
                             check_vma=False)(*args)

    def combine(self, local, bufs, *args):
        """The reverse of `dispatch`: buffers [E, token_shards * C, ...] go back to their token shards by
        all-to-all, where `local(buffers [E, C, ...], *args)` gives that shard's tokens."""
        tok, grp = self._specs()
        a2a = functools.partial(jax.lax.all_to_all, axis_name=self.spmd_axis_name, split_axis=1, concat_axis=0,
                                tiled=True)
        body = lambda b, *a: local(jax.tree.map(a2a, b), *a)  # noqa: E731
        return jax.shard_map(body, mesh=self.mesh, in_specs=(grp,) + (tok,) * len(args), out_specs=tok,
                             check_vma=False)(bufs, *args)


def expert_sharding(kernel_axes: LogicalAxes, name: str = "", *, mesh=None, rules=None, gather: tuple = ("fsdp",),
                    reshard_after_forward: Optional[bool] = None) -> Optional[ExpertSharding]:
    """The ExpertSharding of stacked kernels [E, K, N] with logical `kernel_axes` (e.g. ("expert", "embed",
    "mlp")), from the given or current mesh and rules; None without a mesh or when the expert dim is whole
    (the grouped op then runs as before, every device computing every expert). reshard_after_forward: as in
    `weight_sharding`, for each expert's kernel."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None or len(kernel_axes) != 3:
        return None
    rules = rules if rules is not None else current_rules()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec = mesh_axes(tuple(kernel_axes), rules, mesh)
    axes = tuple(a for a in _axes(spec[0]) if sizes[a] > 1)
    if not axes:
        return None
    batch = _axes(mesh_axes(("batch",), rules, mesh)[0])
    tokens = tuple(a for a in batch if a not in axes and sizes[a] > 1)
    kernel = WeightSharding(mesh, (spec[1], spec[2]), gather, name, tokens,
                            _reshard_after_forward(reshard_after_forward))
    return ExpertSharding(mesh, axes, kernel, tokens, name, tuple(a for a in batch if sizes[a] > 1))
