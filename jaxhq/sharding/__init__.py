"""Sharding with jit and meshes: mesh axes (data, fsdp, tensor, expert), logical-axis rules, quantized
all-gather of FSDP weights and global amaxes. See docs/sharding.md."""
from .amax import global_amax
from .gather import ShardingError, WeightSharding, block_shape, weight_sharding
from .mesh import AXES, make_mesh
from .rules import (DEFAULT_RULES, axis_rules, constrain, current_mesh, current_rules, logical_specs, mesh_axes,
                    named_sharding, shard_state, state_shardings)

__all__ = ["AXES", "DEFAULT_RULES", "ShardingError", "WeightSharding", "axis_rules", "block_shape", "constrain",
           "current_mesh", "current_rules", "global_amax", "logical_specs", "make_mesh", "mesh_axes",
           "named_sharding", "shard_state", "state_shardings", "weight_sharding"]
