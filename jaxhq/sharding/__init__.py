"""Sharding with jit and meshes: mesh axes (data, fsdp, tensor, expert), logical-axis rules, quantized
all-gather of FSDP weights, sequence parallelism with quantized gathers, expert parallelism and global amaxes.
See docs/sharding.md."""
from .amax import global_amax
from .experts import ExpertSharding, expert_sharding
from .gather import ShardingError, WeightSharding, block_shape, fsdp_options, weight_sharding
from .mesh import AXES, make_mesh
from .rules import (DEFAULT_RULES, axis_rules, constrain, current_mesh, current_rules, logical_specs, mesh_axes,
                    named_sharding, shard_state, state_shardings)
from .sequence import SequencePlan, sequence_plan

__all__ = ["AXES", "DEFAULT_RULES", "ExpertSharding", "SequencePlan", "ShardingError", "WeightSharding",
           "axis_rules", "block_shape", "constrain", "current_mesh", "current_rules", "expert_sharding",
           "fsdp_options", "global_amax", "logical_specs", "make_mesh", "mesh_axes", "named_sharding",
           "sequence_plan", "shard_state", "state_shardings", "weight_sharding"]
