"""Sharding for the FFI calls: `custom_partitioning` with a Shardy `sharding_rule`, so that quantizing a
sharded 2D tensor runs the kernel on each shard and keeps every output sharded like the input (rowwise
copies like x, columnwise copies transposed) without gathering anything.

Blocks never straddle shards: the rule ties each axis of x to the outputs through a compound factor whose
inner size is the block granularity (e.g. K = (k 32) for MXFP8 rowwise); an axis that is one block or not a
whole number of blocks is kept whole by the rule, and an axis whose shards would split blocks is gathered
for the kernel (same results as unsharded; XLA moves the data). A per-tensor amax is reduced (max) over every
mesh axis x is split on, so a sharded call gives the same numbers as an unsharded one.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from ..sharding.amax import pmax_nan
from . import primitives as P

# Block extent of a copy's format along (its rows, its columns); NVFP4 2D tiles and 128x128 tiles span rows.
def _extent(fmt: int, opts: int) -> tuple:
    if fmt == P.MXFP8:
        return 1, 32
    if fmt == P.NVFP4:
        return (16 if opts & P.OPT_BLOCK2D else 1), 16
    if fmt == P.FP8_BLOCK_1x128:
        return 1, 128
    if fmt == P.FP8_BLOCK_128x128:
        return 128, 128
    if fmt == P.FP8_TENSOR:
        return 1, 1
    return 1, 1


def granularity(row, col) -> tuple:
    """(gm, gk): the multiples that a shard of x [M, K] must have along M and K for this pair of formats."""
    (rf, ro), (cf, co) = row, col
    rr, rc = _extent(rf, ro) if rf else (1, 1)
    cr, cc = _extent(cf, co) if cf else (1, 1)
    if cf == P.NVFP4 and co & P.OPT_RHT:
        cc = 16
    return math.lcm(rr, cc), math.lcm(rc, cr)


def _out_dims(fmt: int, opts: int, rows_f: str, cols_f: str, rows_n: int, cols_n: int, g_rows: int, g_cols: int,
              sizes: dict, tag: str) -> tuple:
    """Dimension expressions of (data, scale) of one copy [rows_n, cols_n], given the factors of its axes."""
    def expr(base, n, g, div, name):
        # an axis of n elements whose x-axis factor is `base` (granularity g), divided by `div`
        if base.startswith("_"):  # the x axis is not blockable: a fresh, unrelated factor
            return base + name
        inner = g // div
        if inner == 1:
            return base
        sizes[base + name] = inner
        return f"({base} {base}{name})"
    br, bc = _extent(fmt, opts)
    d_cols = expr(cols_f, cols_n, g_cols, 2 if fmt == P.NVFP4 and not opts & P.OPT_DECODED else 1, tag + "d")
    d_rows = expr(rows_f, rows_n, g_rows, 1, tag + "r")
    data = f"{d_rows} {d_cols}"
    if fmt == P.FP8_TENSOR:
        return data, ""  # scale_inv: one per batch element
    s_rows = expr(rows_f, rows_n, g_rows, 128 if fmt == P.FP8_BLOCK_128x128 else 1, tag + "s")
    s_cols = expr(cols_f, cols_n, g_cols, bc, tag + "c")
    return data, f"{s_rows} {s_cols}"


def _rule(row, col, m: int, k: int, nbatch: int = 0, want_amax: bool = False, act: int = 0):
    gm, gk = granularity(row, col)
    sizes, repl = {}, []
    def axis(name, n, g):
        if name == "k" and act:  # an activation's gradient: h and dy keep their last axis whole
            repl.append(name)
            return "_" + name, name
        if g > 1 and n % g == 0 and n > g:
            sizes[name + "g"] = g
            return name, f"({name} {name}g)"
        if g > 1:  # one block, or not a whole number of blocks: keep this axis whole
            repl.append(name)
            return "_" + name, name
        return name, name
    mf, mx = axis("m", m, gm)
    kf, kx = axis("k", k, gk)
    lead = "".join(f"b{i} " for i in range(nbatch))  # leading (vmapped) batch dims, shardable
    outs = []
    for (fmt, opts), rf, cf, rn, cn, g_r, g_c, tag in ((row, mf, kf, m, k, gm, gk, "a"),
                                                       (col, kf, mf, k, m, gk, gm, "b")):
        if fmt == P.NONE:
            continue
        d, s = _out_dims(fmt, opts, rf, cf, rn, cn, g_r, g_c, sizes, tag)
        outs += [d, s]
    # fresh factors of unblockable axes: plain names
    fix = lambda e: " ".join(t.lstrip("_") if t.startswith("_") else t for t in e.split(" "))  # noqa: E731
    results = [(lead + fix(o)).strip() for o in outs] + ([lead.strip()] if want_amax else [])  # amax: per batch
    dy = ""
    if act:  # dy [M, K] (gated: [M, K / 2], a factor of its own, whole too)
        dy = f"{lead}{mx} {'kh' if act & P.GATED else kx}, "
        repl += ["kh"] if act & P.GATED else []
    rule = f"{lead}{mx} {kx}, {dy}{lead}sr, {lead}sc, {lead}t -> " + ", ".join(results)
    # a factor used only inside compound factors needs its size spelled out
    import re
    bare = re.sub(r"\([^)]*\)", " ", rule).replace(",", " ").replace("->", " ").split()
    for name, n, g in (("m", m, gm), ("k", k, gk)):
        if f"{name}g" in sizes and name not in bare:
            sizes[name] = n // g
    return rule, sizes, tuple(repl)


def _present(outs):
    return tuple(o for o in outs if o is not None)


def _local_quantize(row, col, x, *rest, want_amax=False, amax_eps=0.0, act=0):
    """P.quantize of (x, scale_row, scale_col, seed), or with `act` of (h, dy, scale_row, scale_col, seed)."""
    dy, s_row, s_col, seed = rest if act else (None, *rest)
    return _present(P.quantize(x, (s_row, s_col), seed, row, col, want_amax=want_amax, amax_eps=amax_eps, dy=dy,
                               act=act))


def _specs(row, col, m_axes, k_axes, lead=(), want_amax=False):
    specs = []
    for (fmt, _), a, b in ((row, m_axes, k_axes), (col, k_axes, m_axes)):
        if fmt == P.NONE:
            continue
        specs.append(PS(*lead, a, b))
        specs.append(PS(*lead) if fmt == P.FP8_TENSOR else PS(*lead, a, b))  # scale_inv, or block scales
    if want_amax:  # reduced over the shards of M and K in the partitioned call
        specs.append(PS(*lead))
    return specs


def _shard_index(mesh, axes):
    """Linear index of this device's shard along a dimension split over `axes` (major to minor)."""
    if axes is None:
        return jnp.uint32(0)
    idx = jnp.uint32(0)
    for a in (axes if isinstance(axes, tuple) else (axes,)):
        idx = idx * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
    return idx


def _mesh_size(mesh, axes):
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def _split_spec(spec, nbatch: int) -> tuple:
    """(mesh axes of the leading batch dims, of M, of K) from an operand's PartitionSpec."""
    spec = tuple(spec) + (None,) * (nbatch + 2 - len(spec))
    return spec[:nbatch], spec[nbatch], spec[nbatch + 1]


def quantize(x, scales, seed, row, col, want_amax: bool = False, amax_eps: float = 0.0, dy=None, act: int = 0):
    """P.quantize for x [..., M, K] under jit with a mesh: each shard quantized in place (leading batch dims,
    from vmap, may be sharded too); returns the present outputs (row_data, row_scale?, col_data, col_scale?,
    amax?); the amax is the max over every shard, as unsharded. With `act` (and dy): the copies of an
    activation's gradient (P.quantize), sharded along M only."""
    make = lambda nb: _quantize_fn(x.shape[-2:], row, col, nb, want_amax, amax_eps, act)  # noqa: E731
    return _batched(make, x.ndim - 2)(x, *(() if dy is None else (dy,)), *P.scale_operands(scales, x.shape), seed)


def _quantize_fn(shape, row, col, nbatch: int, want_amax: bool = False, amax_eps: float = 0.0, act: int = 0):
    """The custom_partitioning quantize of x [b_1..b_nbatch, M, K] (with `act`: of h and dy)."""
    m, k = shape
    rule, sizes, repl = _rule(row, col, m, k, nbatch, want_amax, act)
    gm, gk = granularity(row, col)

    @partial(custom_partitioning)
    def f(x, *rest):
        return _local_quantize(row, col, x, *rest, want_amax=want_amax, amax_eps=amax_eps, act=act)

    def axes_of(mesh, spec):
        """The mesh axes x keeps: an axis of M or K whose shards would split blocks (or that is not a whole
        number of blocks, so that its last block is padded) is gathered for the kernel instead."""
        lead, m_axes, k_axes = _split_spec(spec, nbatch)
        if m % gm or (m // _mesh_size(mesh, m_axes)) % gm:
            m_axes = None
        if act or k % gk or (k // _mesh_size(mesh, k_axes)) % gk:
            k_axes = None
        return lead, m_axes, k_axes

    def partition(mesh, arg_shapes, result_shape):
        lead, m_axes, k_axes = axes_of(mesh, arg_shapes[0].sharding.spec)
        outs = tuple(NamedSharding(mesh, s) for s in _specs(row, col, m_axes, k_axes, lead, want_amax))
        per_batch = NamedSharding(mesh, PS(*lead, None))
        split = tuple(a for s in (m_axes, k_axes) if s is not None for a in (s if isinstance(s, tuple) else (s,)))
        args = (NamedSharding(mesh, PS(*lead, m_axes, k_axes)),) * (2 if act else 1) + (per_batch,) * 3

        def lower(x, *rest):  # this shard's offsets in x, so stochastic rounding draws global positions
            *dy, s_row, s_col, seed = rest
            lm, lk = x.shape[-2:]
            offsets = jnp.stack([_shard_index(mesh, m_axes) * lm, _shard_index(mesh, k_axes) * lk])
            seed = seed.at[..., 2:4].set(offsets.astype(jnp.uint32))
            res = _local_quantize(row, col, x, *dy, s_row, s_col, seed, want_amax=want_amax, amax_eps=amax_eps,
                                  act=act)
            if want_amax and split:
                res = res[:-1] + (pmax_nan(res[-1], split),)
            return res
        return mesh, lower, outs, args

    def infer(mesh, arg_shapes, result_shape):
        lead, m_axes, k_axes = axes_of(mesh, arg_shapes[0].sharding.spec)
        return tuple(NamedSharding(mesh, s) for s in _specs(row, col, m_axes, k_axes, lead, want_amax))

    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                    need_replication_factors=repl, **sizes)
    return f


def amax(x, rht: bool = False):
    """P.amax for x [..., M, K] under jit with a mesh: local amaxes, then a max over the mesh axes M and K are
    split on (leading batch dims keep their own amaxes and their sharding)."""
    return _batched(lambda nb: _amax_fn(x.shape[-2:], rht, nb), x.ndim - 2)(x)


def _amax_fn(shape, rht: bool, nbatch: int):
    m, k = shape
    lead = [f"b{i}" for i in range(nbatch)]
    rule = " ".join(lead + ["m", "k"]) + " -> " + ", ".join([" ".join(lead)] * 2)

    @custom_partitioning
    def f(x):
        return P.amax(x, rht)

    def partition(mesh, arg_shapes, result_shape):
        lead, m_axes, k_axes = _split_spec(arg_shapes[0].sharding.spec, nbatch)
        axes = tuple(a for s in (m_axes, k_axes) if s is not None for a in (s if isinstance(s, tuple) else (s,)))
        if rht and (m // _mesh_size(mesh, m_axes)) % 16:
            raise ValueError(f"jaxhq amax: the RHT groups 16 rows; a shard of x [{m}, {k}] has "
                             f"{m // _mesh_size(mesh, m_axes)} rows")

        def lower(x):
            a, r = P.amax(x, rht)
            return pmax_nan(a, axes), pmax_nan(r, axes)
        out = NamedSharding(mesh, PS(*lead))
        return mesh, lower, (out, out), (NamedSharding(mesh, PS(*lead, m_axes, k_axes)),)

    def infer(mesh, arg_shapes, result_shape):
        out = NamedSharding(mesh, PS(*_split_spec(arg_shapes[0].sharding.spec, nbatch)[0]))
        return out, out

    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                    reduction_factors=("m", "k"))
    return f


def _batched(make, nbatch: int):
    """The custom_partitioning call `make(nbatch)` (which has no batching rule) made vmappable: under vmap it
    hands over to `make(nbatch + 1)`, the same partitioned call with one more leading batch dim, so a vmapped
    call (e.g. the experts of a grouped dense) stays sharded, its batch dims included."""
    fn = jax.custom_batching.custom_vmap(lambda *args: make(nbatch)(*args))

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jax.numpy.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        out = _batched(make, nbatch + 1)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return fn


# -- GEMMs ----------------------------------------------------------------------------------------------------
# out [M, N] = A [M, K] @ B [N, K].T on storages. Rows of A (tokens) and rows of B (a column-parallel weight)
# keep their sharding; a contraction split on K (row-parallel, wgrad over tokens) gives partial sums that one
# psum (or a psum_scatter, where the output is wanted split on those axes) adds up. Nothing is gathered unless
# a shard would cut a quantization block or the kernel cannot take the local shape; then that dim is whole.
# The partial sums travel in the output's dtype.
def _axes_tuple(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


class _GemmSides:
    """The leaves of A and B (data, scales, amax) and, per leaf, how many logical rows and K elements one entry
    covers (None for a scalar): a shard is whole blocks for every leaf when its size along M (N, K) is a
    multiple of `gm` (`gn`, `gk`), the lcm of those counts and of the format's block rows. A transposed B
    (`Storage.transposed`) has its leaves' last two dims as (K, N)."""

    def __init__(self, a, b):
        from ..sharding.gather import block_shape
        self.a_leaves, self.a_tree = jax.tree.flatten(a)
        self.b_leaves, self.b_tree = jax.tree.flatten(b)
        self.a, self.b = a, b
        (self.m, self.k), self.n = a.shape, b.shape[0]
        self.b_kn = b.transposed

        def per_entry(s, leaves):
            rows, k = s.shape
            nb = s.data.ndim - 2
            dims = lambda l: l.shape[-1:-3:-1] if s.transposed else l.shape[-2:]  # noqa: E731  (rows, K) entries
            return [None if l.ndim == nb else (-(-rows // dims(l)[0]), -(-k // dims(l)[1])) for l in leaves]
        self.a_per, self.b_per = per_entry(a, self.a_leaves), per_entry(b, self.b_leaves)
        per = [p for p in self.a_per + self.b_per if p]
        self.gk = math.lcm(*(p[1] for p in per))
        self.gm = math.lcm(block_shape(a.quantizer)[0], *(p[0] for p in self.a_per if p))
        self.gn = math.lcm(block_shape(b.quantizer)[0], *(p[0] for p in self.b_per if p))

    def rule(self, nbatch: int, has_bias: bool, has_acc: bool):
        """(Shardy rule, factor sizes, factors to keep whole): factors m, n, k, compound where an entry covers
        several elements ("(k k32)" for an MXFP8 scale column); a dim that cannot be split into whole blocks
        has its own factor, kept whole."""
        sizes, whole, bare = {}, [], set()
        fresh = iter(range(10 ** 6))

        def dim(base, full, g, per):
            if full % g or full // g < 2:
                name = f"{base}x{next(fresh)}"
                whole.append(name)
                return name
            inner = g // per
            if inner == 1:
                bare.add(base)
                return base
            sizes[f"{base}{inner}"] = inner
            return f"({base} {base}{inner})"

        lead = "".join(f"b{i} " for i in range(nbatch))
        ins = []
        for leaves, pers, rows, full, g, kn in ((self.a_leaves, self.a_per, "m", self.m, self.gm, False),
                                                (self.b_leaves, self.b_per, "n", self.n, self.gn, self.b_kn)):
            for p in pers:
                if p is None:
                    ins.append(lead.strip())
                    continue
                r, kk = dim(rows, full, g, p[0]), dim("k", self.k, self.gk, p[1])
                ins.append(lead + (f"{kk} {r}" if kn else f"{r} {kk}"))
        m_out, n_out = dim("m", self.m, self.gm, 1), dim("n", self.n, self.gn, 1)
        if has_bias:
            ins.append(lead + n_out)
        if has_acc:
            ins.append(f"{lead}{m_out} {n_out}")
        for base, full, g in (("m", self.m, self.gm), ("n", self.n, self.gn), ("k", self.k, self.gk)):
            if base not in bare and any(f"({base} " in e for e in ins + [m_out, n_out]):
                sizes[base] = full // g  # only inside compound factors: Shardy needs its size
        rule = ", ".join(ins) + f" -> {lead}{m_out} {n_out}"
        return rule, sizes, tuple(whole), "k" in bare or "k" in sizes

    def local(self, ways):
        """(A, B) with the logical shapes of one shard, `ways` = (M, N, K) split counts."""
        wm, wn, wk = ways
        return (dataclasses.replace(self.a, shape=(self.m // wm, self.k // wk)),
                dataclasses.replace(self.b, shape=(self.n // wn, self.k // wk)))


def gemm(kernel, a, b, out_dtype, *, bias=None, accumulate=None):
    """`kernel(a, b, out_dtype, bias=, accumulate=)` (an FFI GEMM on storages A [M, K], B [N, K]) as a
    custom_partitioning call: under jit with a mesh each device runs the kernel on its shards (see above)."""
    sides = _GemmSides(a, b)
    extra = tuple(x for x in (bias, accumulate) if x is not None)
    make = lambda nb: _gemm_fn(kernel, sides, jnp.dtype(out_dtype), bias is not None, accumulate is not None, nb)  # noqa: E731
    return _batched(make, a.data.ndim - 2)(*sides.a_leaves, *sides.b_leaves, *extra)


def _gemm_fn(kernel, sides: _GemmSides, out_dtype, has_bias: bool, has_acc: bool, nbatch: int):
    """The custom_partitioning GEMM of leaves (A's, B's, bias?, accumulate?) with `nbatch` leading batch dims."""
    na, nb_ = len(sides.a_leaves), len(sides.b_leaves)
    pers = sides.a_per + sides.b_per

    def split(leaves, ways=(1, 1, 1)):
        la, lb = sides.local(ways)
        a = dataclasses.replace(jax.tree.unflatten(sides.a_tree, leaves[:na]), shape=la.shape)
        b = dataclasses.replace(jax.tree.unflatten(sides.b_tree, leaves[na:na + nb_]), shape=lb.shape)
        rest = list(leaves[na + nb_:])
        return a, b, rest.pop(0) if has_bias else None, rest.pop(0) if has_acc else None

    def call(a, b, bias, acc, dtype):
        fn = lambda a, b, bias, acc: kernel(a, b, dtype, bias=bias, accumulate=acc)  # noqa: E731
        for _ in range(nbatch):  # leading batch dims (vmap): one kernel call per batch element
            fn = jax.vmap(fn)
        return fn(a, b, bias, acc)

    @custom_partitioning
    def f(*leaves):
        return call(*split(leaves), out_dtype)

    def fits(mesh, axes) -> bool:
        ways = tuple(_mesh_size(mesh, _entry(x)) for x in axes)
        for full, g, w in zip((sides.m, sides.n, sides.k), (sides.gm, sides.gn, sides.gk), ways):
            if full % w or (w > 1 and (full // w) % g):
                return False
        if ways == (1, 1, 1):
            return True
        from .gemm import GemmUnsupported
        la, lb = sides.local(ways)

        def shaped(s, rows_w):
            w = (ways[2], rows_w) if s.transposed else (rows_w, ways[2])
            return jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape if l.ndim < 2 else l.shape[:-2] + (
                l.shape[-2] // w[0], l.shape[-1] // w[1]), l.dtype), s)
        try:  # the kernel must take the local shapes too (alignment of N, K % 16, ...)
            jax.eval_shape(lambda a, b: kernel(a, b, out_dtype), shaped(la, ways[0]), shaped(lb, ways[1]))
        except GemmUnsupported:
            return False
        return True

    def plan(mesh, arg_shapes, result_shape):
        """Mesh axes of (batch dims, M, N, K) and the K axes the output is scattered on along M."""
        lead, m, ka = _split_spec(arg_shapes[0].sharding.spec, nbatch)
        _, n, kb = _split_spec(arg_shapes[na].sharding.spec, nbatch)
        if sides.b_kn:
            n, kb = kb, n
        m = _axes_tuple(m)
        n = tuple(x for x in _axes_tuple(n) if x not in m)
        k = tuple(x for x in (_axes_tuple(ka) or _axes_tuple(kb)) if x not in m + n)
        for drop in range(4):  # keep K, N, M split while the shards are whole blocks the kernel takes
            axes = (m if drop < 3 else (), n if drop < 2 else (), k if drop < 1 else ())
            if fits(mesh, axes):
                break
        m, n, k = axes
        scatter = ()
        if k and result_shape is not None and getattr(result_shape, "sharding", None) is not None:
            want = tuple(x for x in _axes_tuple(_split_spec(result_shape.sharding.spec, nbatch)[1])
                         if x in k and x not in m)
            if want and fits(mesh, (m + want, n, k)):
                scatter = want
        return lead, m, n, k, scatter

    def shardings(mesh, lead, m, n, k, scatter):
        specs = [PS(*lead) if p is None else
                 PS(*lead, _entry(k), _entry(n)) if i >= na and sides.b_kn else
                 PS(*lead, _entry(m if i < na else n), _entry(k))
                 for i, p in enumerate(pers)]
        out = PS(*lead, _entry(m + scatter), _entry(n))
        specs += ([PS(*lead, _entry(n))] if has_bias else []) + ([out] if has_acc else [])
        return [NamedSharding(mesh, s) for s in specs], NamedSharding(mesh, out)

    def partition(mesh, arg_shapes, result_shape):
        lead, m, n, k, scatter = plan(mesh, arg_shapes, result_shape)
        args, out = shardings(mesh, lead, m, n, k, scatter)
        ways = tuple(_mesh_size(mesh, _entry(x)) for x in (m, n, k))

        def lower(*leaves):
            a, b, bias, acc = split(leaves, ways)
            if not k:
                return call(a, b, bias, acc, out_dtype)
            # partial sums over this device's K slice, reduced in the output's dtype (as XLA's partitioned dot
            # does: a bf16 output halves the bytes reduced); bias and accumulate are added once, in fp32
            y = call(a, b, None, None, out_dtype)
            if scatter:
                y = jax.lax.psum_scatter(y, scatter, scatter_dimension=nbatch, tiled=True)
            rest = tuple(x for x in k if x not in scatter)
            y = jax.lax.psum(y, rest) if rest else y
            if bias is not None or acc is not None:
                y = y.astype(jnp.float32)
            if bias is not None:
                y = y + jnp.expand_dims(bias.astype(jnp.float32), -2)
            if acc is not None:
                y = y + acc.astype(jnp.float32)
            return y.astype(out_dtype)
        return mesh, lower, out, tuple(args)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, *plan(mesh, arg_shapes, None))[1]

    rule, sizes, whole, k_factor = sides.rule(nbatch, has_bias, has_acc)
    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                    reduction_factors=("k",) if k_factor else (), need_replication_factors=whole, **sizes)
    return f
