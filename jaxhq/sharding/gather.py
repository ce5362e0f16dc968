"""Quantized all-gather of FSDP weights: each device quantizes its own shard, the gather moves the bytes.

A dense kernel [in, out] sharded on `fsdp` (and maybe `tensor`) is quantized where it lies: the quantize ops
run on the local shard (per-tensor amaxes are global: `jnp.max` of a sharded array under jit is an all-reduce,
see amax.py) and each storage is pinned to the kernel's layout with `with_sharding_constraint`. Only then is
it constrained to the gathered layout (the fsdp axes dropped), so the all-gather the partitioner inserts
carries the quantized data and scales, bitcast to uint8 (bf16: uint16) so no backend widens them to move them. The
result is bit-equal to quantizing the unsharded kernel, provided no block straddles two shards: `check` raises
at trace time where a shard is not a whole number of blocks.
When to gather the columnwise copy (the dgrad's) is FSDP2's `reshard_after_forward`: True (the default) keeps
the residual sharded and gathers it again in the backward; False gathers it in the forward and keeps it
gathered until the backward (no backward gather, more memory held). `fsdp_options` sets it for a block of code.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..formats import COLUMNWISE, MXFP8, NVFP4, ROWWISE, Float8Block, QTensor, QuantizationError, Storage, side
from ..ffi.dispatch import rows_inner_scales
from ..ffi.primitives import swap_rows_inner
from ..formats.quantize import normalize
from .rules import LogicalAxes, current_mesh, current_rules, mesh_axes


# Gathered as raw bits: the CPU backend widens FP8/E8M0 collectives to f16/f32 and bf16 ones to f32.
_RAW = {1: jnp.uint8, 2: jnp.uint16}


class ShardingError(QuantizationError):
    """A weight whose shards cut through its quantization blocks (or cannot be split evenly)."""


def raw_bits(a):
    """(a's bits as unsigned ints of its width, the function that turns such bits back into a's dtype) for 1- and
    2-byte floats; (a, identity) otherwise. Collectives move the bits unchanged, where the CPU backend would widen
    FP8/E8M0 to f16/f32 and bf16 to f32 to move them."""
    dt = a.dtype
    raw = _RAW.get(dt.itemsize) if jnp.issubdtype(dt, jnp.floating) else None
    if raw is None:
        return a, lambda b: b
    return jax.lax.bitcast_convert_type(a, raw), lambda b: jax.lax.bitcast_convert_type(b, dt)


def block_shape(quantizer) -> tuple:
    """(rows, cols) of one scaling block of a plain quantizer's copy; (1, 1) for per-tensor and Identity."""
    if isinstance(quantizer, MXFP8):
        return (1, quantizer.block)
    if isinstance(quantizer, NVFP4):
        return (quantizer.block, quantizer.block) if quantizer.block_2d else (1, quantizer.block)
    if isinstance(quantizer, Float8Block):
        return tuple(quantizer.block)
    return (1, 1)


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_ways(mesh, entry) -> int:
    """How many ways the mesh axes of a PartitionSpec entry (None, a name or a tuple of names) split a dim."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in _axes(entry))


@dataclasses.dataclass(frozen=True)
class WeightSharding:
    """Layout of a dense kernel [in, out] on a mesh and the mesh axes gathered before its GEMMs.

    spec: mesh axes of (in, out), each None, a name or a tuple of names. gather: the axes dropped for use
    (FSDP); the others (tensor) stay split, as Megatron's column/row-parallel GEMMs want. name labels errors.
    reshard_after_forward: the dense op saves the columnwise copy sharded and gathers it in the backward
    (True), or saves it gathered from the forward (False: no backward gather, the gathered copy held meanwhile).
    """

    mesh: Any
    spec: tuple
    gather: tuple = ("fsdp",)
    name: str = ""
    batch: tuple = ()  # mesh axes the tokens of the GEMM operands are split on (the rules' "batch")
    reshard_after_forward: bool = True
    sequence: tuple = ()  # mesh axes the rules split the length of activations on (sequence parallelism)

    def __post_init__(self):
        spec = tuple(None if not _axes(e) else _axes(e) for e in self.spec)
        if len(spec) != 2:
            raise ValueError(f"WeightSharding of {self.name or 'a kernel'}: spec must name the mesh axes of the "
                             f"kernel's 2 dims [in, out], got {self.spec}")
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "gather", tuple(self.gather))

    @property
    def sizes(self) -> dict:
        return dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))

    def ways(self, entry) -> int:
        return mesh_ways(self.mesh, entry)

    def split(self, entry) -> tuple:
        """The mesh axes of a spec entry (None, a name or a tuple of names) that split it (size > 1)."""
        return tuple(a for a in _axes(entry) if self.sizes.get(a, 1) > 1)

    def kernel_spec(self, gathered: bool = False) -> PartitionSpec:
        return PartitionSpec(*(self._keep(e) if gathered else e for e in self.spec))

    def _keep(self, entry):
        kept = tuple(a for a in _axes(entry) if a not in self.gather)
        return kept or None

    def storage_spec(self, axis: str, gathered: bool = False) -> PartitionSpec:
        """Rowwise copies are [out, in], columnwise ones [in, out] (see formats/base.py)."""
        k_in, k_out = self.kernel_spec(gathered)
        return PartitionSpec(k_out, k_in) if axis == ROWWISE else PartitionSpec(k_in, k_out)

    @property
    def needs_gather(self) -> bool:
        return any(a in self.gather for e in self.spec for a in self.split(e))

    # -- trace-time checks ---------------------------------------------------------------------------------
    def check(self, quantizer, kernel_shape, role=None) -> None:
        """Raise ShardingError where a shard of a copy is not a whole number of that copy's blocks."""
        who = f"weight {role}" if role is not None else f"weight {self.name or '(unnamed)'}"
        n_in, n_out = kernel_shape
        q = normalize(quantizer)
        for axis, (rows, cols), (srows, scols) in ((ROWWISE, (n_out, n_in), self.storage_spec(ROWWISE)),
                                                   (COLUMNWISE, (n_in, n_out), self.storage_spec(COLUMNWISE))):
            sq = side(q, axis)
            br, bc = block_shape(sq)
            for size, entry, block, what in ((rows, srows, br, "row"), (cols, scols, bc, "column")):
                ways = self.ways(entry)
                if ways == 1:
                    continue
                shard = size / ways
                if size % ways:
                    raise ShardingError(
                        f"{who}: its {axis} copy [{rows}, {cols}] ({sq.label}) is split {ways} ways along its "
                        f"{what}s (mesh axes {_axes(entry)}), but {size} is not divisible by {ways}")
                if block > 1 and size // ways % block:
                    bl = f"{br}x{bc}" if br > 1 else f"1x{bc}"
                    raise ShardingError(
                        f"{who}: its {axis} copy [{rows}, {cols}] ({sq.label}, {bl} blocks) is split {ways} ways "
                        f"along its {what}s (mesh axes {_axes(entry)}), giving a shard size of "
                        f"{shard:g}, which is not a multiple of the {block}-element block: blocks must not "
                        f"straddle shards. Make that dimension ({size}) a multiple of {ways} x {block} = "
                        f"{ways * block}, or shard this weight fewer ways.")

    # -- the layouts ---------------------------------------------------------------------------------------
    def _constrain(self, a, spec: PartitionSpec):
        if a is None or a.ndim == 0:
            return a  # per-tensor scale and amax: replicated scalars (their amax was reduced globally)
        spec = PartitionSpec(*spec[:a.ndim])
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))

    def _storage(self, s: Optional[Storage], fn) -> Optional[Storage]:
        """s with fn(array, spec of the sharded layout, spec of the gathered one) applied to its data and scales.
        1x128 and MXFP8 scales go to fn in the quantize launch's [blocks, rows] (ffi.primitives.swap_rows_inner,
        the specs swapped likewise), so XLA cancels the swaps around them: the launch's buffer is what is
        constrained and gathered, and the GEMM reads the gathered one, with no transpose either side."""
        if s is None:
            return None
        specs = (self.storage_spec(s.axis), self.storage_spec(s.axis, gathered=True))
        if rows_inner_scales(s) and s.scale_inv.ndim == 2:
            flip = lambda spec: PartitionSpec(*reversed(tuple(spec)))  # noqa: E731
            sc = swap_rows_inner(fn(swap_rows_inner(s.scale_inv), *map(flip, specs)))
        else:
            sc = fn(s.scale_inv, *specs)
        return dataclasses.replace(s, data=fn(s.data, *specs), scale_inv=sc)

    def shard(self, qt: QTensor) -> QTensor:
        """Pin both copies to the kernel's own (sharded) layout, so each device quantizes only its shard."""
        fn = lambda a, spec, _: self._constrain(a, spec)  # noqa: E731
        return dataclasses.replace(qt, rowwise=self._storage(qt.rowwise, fn), columnwise=self._storage(
            qt.columnwise, fn))

    def gathered(self, s: Storage) -> Storage:
        """The copy in the gathered layout; the all-gather moves its data and block scales as uint8 bytes."""
        def fn(a, spec, gathered_spec):
            if a is None or a.ndim == 0:
                return a
            b, back = raw_bits(a)
            b = self._constrain(b, spec)
            return back(self._constrain(b, gathered_spec))
        return self._storage(s, fn)

    def constrain_grad(self, dw):
        """The kernel gradient in the kernel's layout."""
        return self._constrain(dw, self.kernel_spec())

    def wgrad(self, gemm_fn, a: Storage, b: Storage):
        """dw = a . b^T summed over tokens as FSDP does it: each device multiplies its own tokens' quantized
        copies, then a reduce-scatter (fsdp) and all-reduce (other batch axes) put dw in the kernel's layout.
        a: the input's columnwise copy [in, tokens], b: grad_output's [out, tokens]. Left to the partitioner,
        the GEMM may instead move activations (it all-gathers dequantized NVFP4 operands in fp32)."""
        plan = self._wgrad_plan(a, b)
        if plan is None:
            return self.constrain_grad(gemm_fn(a, b))
        batch, scatter, rest = plan
        k_in, k_out = self.kernel_spec(gathered=True)
        nb = self.ways(batch)

        def spec_of(s, rows):
            return jax.tree.map(lambda x: PartitionSpec() if x.ndim == 0 else PartitionSpec(rows, batch), s)

        def local(s, rows_entry):
            return dataclasses.replace(s, shape=(s.shape[0] // self.ways(rows_entry), s.shape[1] // nb))

        def body(a, b):
            dw = gemm_fn(local(a, k_in), local(b, k_out))
            for dim, axes in scatter:
                dw = jax.lax.psum_scatter(dw, axes, scatter_dimension=dim, tiled=True)
            return jax.lax.psum(dw, rest) if rest else dw

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(spec_of(a, k_in), spec_of(b, k_out)),
                           out_specs=self.kernel_spec(), check_vma=False)
        return fn(a, b)

    def _wgrad_plan(self, a: Storage, b: Storage):
        """(token axes, [(kernel dim, axes to scatter on)], axes to all-reduce) or None to leave it to XLA."""
        batch = self.split(self.batch)
        if not batch:
            return None
        scatter, used = [], set()
        for dim, entry in enumerate(self.spec):
            g = tuple(x for x in self.split(entry) if x in self.gather)
            other = [x for x in _axes(entry) if x not in g and x in batch]
            if other or any(x not in batch for x in g):
                return None  # a kernel dim split on a token axis that is not gathered: no FSDP pattern
            if g:
                scatter.append((dim, g))
                used.update(g)
        nb = self.ways(batch)
        for s, rows_entry in ((a, self.kernel_spec(True)[0]), (b, self.kernel_spec(True)[1])):
            rows, toks = s.shape
            br, bc = block_shape(s.quantizer)
            if toks % nb or (toks // nb) % max(bc, 2 if isinstance(s.quantizer, NVFP4) else 1):
                return None  # token shards that are not whole blocks: the quantization itself moved data
            if rows % self.ways(rows_entry) or (rows // self.ways(rows_entry)) % br:
                return None
        return batch, scatter, tuple(x for x in batch if x not in used)


_RESHARD_AFTER_FORWARD = contextvars.ContextVar("jaxhq_reshard_after_forward", default=True)


@contextlib.contextmanager
def fsdp_options(*, reshard_after_forward: bool = True):
    """FSDP choices for the weights whose sharding is built inside the block (`weight_sharding` and
    `expert_sharding` without the keyword, hence every jaxhq layer). Read when the step is traced: a jitted
    function traced outside the block keeps its choice, so enter the block around the first call (or the lower)."""
    token = _RESHARD_AFTER_FORWARD.set(bool(reshard_after_forward))
    try:
        yield
    finally:
        _RESHARD_AFTER_FORWARD.reset(token)


def _reshard_after_forward(value: Optional[bool] = None) -> bool:
    """`value`, or when None the one of the enclosing `fsdp_options` block (default True)."""
    return _RESHARD_AFTER_FORWARD.get() if value is None else bool(value)


def weight_sharding(kernel_axes: LogicalAxes, name: str = "", *, mesh=None, rules=None, gather: tuple = ("fsdp",),
                    reshard_after_forward: Optional[bool] = None) -> Optional[WeightSharding]:
    """The WeightSharding of a kernel [in, out] with logical `kernel_axes` (a dim may fuse names, e.g.
    ("embed", ("heads", "kv"))), from the given or current mesh (`jax.set_mesh`) and rules
    (`nn.logical_axis_rules`); None without a mesh, which makes the dense op unsharded as before.
    reshard_after_forward: see WeightSharding; None takes it from `fsdp_options` (default True)."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        return None
    rules = rules if rules is not None else current_rules()
    batch = _axes(mesh_axes(("batch",), rules, mesh)[0])
    sequence = _axes(mesh_axes(("batch", "length"), rules, mesh)[1])
    return WeightSharding(mesh, tuple(mesh_axes(kernel_axes, rules, mesh)), gather, name, batch,
                          _reshard_after_forward(reshard_after_forward), sequence)
