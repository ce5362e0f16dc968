"""`make_mesh`: a device mesh with the four named axes every jaxhq sharding rule refers to.

The mesh always has the four axes data, fsdp, tensor and expert (size 1 when unused), so that one set of rules
serves every combination. Axis types are Auto: jit with NamedSharding and `with_sharding_constraint`, the partitioner
placing the collectives.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor", "expert")
MESH_ORDER = ("data", "expert", "fsdp", "tensor")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, expert: int = 1, *,
              devices: Optional[Sequence] = None) -> Mesh:
    """A Mesh of shape (data, fsdp, tensor, expert) over `devices` (default: all), sizes multiplying to their count.

    `tensor` is innermost, so tensor-parallel groups are neighbouring devices (one NVLink island on a GPU host).
    """
    sizes = dict(data=data, fsdp=fsdp, tensor=tensor, expert=expert)
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"make_mesh: axis sizes must be positive integers, got {bad}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need != len(devices):
        raise ValueError(f"make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} x expert={expert} = {need} "
                         f"devices, but {len(devices)} are given ({jax.default_backend()}); on the CPU set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax")
    # Outer to inner: data, expert, fsdp, tensor (the most communicating axis on the closest devices).
    return jax.make_mesh((data, expert, fsdp, tensor), MESH_ORDER, axis_types=(AxisType.Auto,) * 4,
                         devices=devices)
