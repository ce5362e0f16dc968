"""`quantize` and `dequantize`: the entry points that turn an array into a QTensor with the copies asked for.

Gradients: `quantize` stops them (its outputs are codes, not differentiable values), so
`dequantize(quantize(x))` has a zero gradient; `fake_quantize` is the straight-through version, whose
gradient is the identity. Training gets its gradients from the dense op's custom_vjp, not from here.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterable, Optional, Union

import jax
import jax.numpy as jnp

from .base import COLUMNWISE, ROWWISE, USAGES, QTensor, QuantizationError, Quantizer, check_input
from .hybrid import Hybrid, side

Usage = Union[str, Iterable[str]]


@dataclasses.dataclass(frozen=True)
class ActivationGrad:
    """The gradient of an activation's input, as `quantize` takes it: from the activation's input h and the
    gradient dy of its output. Where a kernel takes the pair (jaxhq.ffi.dispatch.quantize_copies' act_grad), the
    copies are made in that one launch and the gradient is never written; elsewhere `grad()` computes it and it is
    quantized as any tensor. act: the kernels' activation id (jaxhq.ffi.primitives ACT_* | GATED)."""
    h: Any
    dy: Any
    act: int
    grad: Callable[[], Any]

    @property
    def shape(self):
        return self.h.shape

    @property
    def dtype(self):
        return self.h.dtype

    @property
    def ndim(self):
        return self.h.ndim


def normalize(quantizer: Quantizer) -> Quantizer:
    """Hybrid(Q, Q) -> Q, so the two are the same computation (and the same bits) everywhere."""
    if isinstance(quantizer, Hybrid) and quantizer.rowwise == quantizer.columnwise:
        return quantizer.rowwise
    return quantizer


def normalize_usage(usage: Usage) -> tuple:
    usage = (usage,) if isinstance(usage, str) else tuple(usage)
    bad = [u for u in usage if u not in USAGES]
    if bad or not usage:
        raise ValueError(f"usage must be a non-empty subset of {USAGES}, got {usage}")
    return tuple(u for u in USAGES if u in usage)


def init_state(quantizer: Quantizer):
    """Initial state of a stateful quantizer (delayed scaling), None for stateless ones.

    For a Hybrid with a stateful side: {"rowwise": ..., "columnwise": ...} with the stateful sides only.
    """
    q = normalize(quantizer)
    if isinstance(q, Hybrid):
        st = {a: side(q, a).init_state() for a in USAGES if side(q, a).stateful}
        return st or None
    return q.init_state() if q.stateful else None


def _side_state(q: Quantizer, state, axis: str):
    if isinstance(q, Hybrid):
        return None if state is None else state.get(axis)
    return state


def update_state(quantizer: Quantizer, state, qt: QTensor):
    """The next state of a stateful quantizer after `qt` was quantized with `state` (amax from qt)."""
    q = normalize(quantizer)
    if state is None:
        return None
    with jax.named_scope(STATE_SCOPE):  # profiles attribute these ops to the quantizers' state
        if isinstance(q, Hybrid):
            return {a: side(q, a).update_state(st, _amax_of(qt, a)) for a, st in state.items()}
        return q.update_state(state, _amax_of(qt, None))


def _amax_of(qt: QTensor, axis: Optional[str]):
    if axis is None:
        axis = ROWWISE if qt.rowwise is not None else COLUMNWISE
    return qt.get(axis).amax


def kernel_platforms() -> tuple:
    """Where `quantize` runs the FFI kernels: JAXHQ_KERNELS = "gpu" (default), "all" (CPU too) or "off".

    The CPU default is the jnp reference (same numerics; XLA fuses it into the surrounding program).
    """
    mode = os.environ.get("JAXHQ_KERNELS", "gpu").lower()
    if mode not in ("gpu", "all", "off"):
        raise ValueError(f"JAXHQ_KERNELS must be gpu, all or off, got {mode!r}")
    return {"gpu": ("cuda",), "all": ("cuda", "cpu"), "off": ()}[mode]


# Per format family, which path makes its copies where kernels run: "kernel" (one FFI launch for both copies)
# or "xla" (the jnp reference, which XLA fuses into the op that produces x and into the amax). Chosen by the
# training step on an H100 (benchmarks/train_step.py --paths; docs/ffi.md "Choosing the path"): the kernel
# won for every family (step vs bf16, kernel / XLA: fp8_current 0.80 / 0.91, fp8_delayed 0.81 / 0.93,
# fp8_block 0.83 / 1.00, mxfp8 1.12 / 1.50, nvfp4 1.40 / 3.69).
# "amax" is the per-tensor amax that FP8 current scaling and NVFP4's global scale read before quantizing: the
# jaxhq_amax kernel, or XLA's reduction, which it fuses into the op that produces x (the transformed amax of the
# Hadamard side always comes from the kernel, in the same pass as the plain one). XLA's won: fp8_current step
# 37.1 against 38.6 ms, nvfp4 68.4 against 68.7 ms.
# "act_grad": an activation's input gradient (ActivationGrad) quantized by the kernel from h and dy ("kernel",
# where one takes them) or computed by XLA first and then quantized ("xla"), or the families ('+'-joined) whose
# copies take the launch. The FP8 ones do: the launch is 1.1-1.25x faster than XLA's gradient plus the quantize
# kernel at fc1's shape, and in the H100-preset step's profile it takes 0.21-0.28 ms a step off the device's busy
# time (fp8_delayed, fp8_block); MXFP8's decoded copies gained nothing there (within 0.01 ms) and took 0.22 GiB
# more peak memory, so XLA computes its gradient (docs/ffi.md). The launch is taken for gradients of at least
# ACT_GRAD_MIN_ELEMENTS elements only: below, XLA's gradient + the quantize kernel is the faster pair (H200,
# benchmarks/act_grad.py, swiglu, launch / pair: 0.83-1.04x at [4096, 2 x 3584] and [8192, 2 x 3584],
# 0.99-1.01x at [4096, 2 x 14336], 1.06x at [8192, 2 x 14336]; in the quick preset's step, this rule against the
# launch at every size: fp8_delayed 0.937 / 0.960x bf16, fp8_block 0.944 / 0.970x, docs/ffi.md).
ACT_GRAD_MIN_ELEMENTS = 1 << 26
DEFAULT_PATHS = {"fp8": "kernel", "fp8_delayed": "kernel", "mxfp8": "kernel", "nvfp4": "kernel",
                 "fp8_block": "kernel", "amax": "xla", "act_grad": "fp8+fp8_delayed+fp8_block"}
FAMILIES = tuple(f for f in DEFAULT_PATHS if f not in ("amax", "act_grad"))  # format families (Quantizer.name)


def quantize_paths() -> dict:
    """DEFAULT_PATHS (every family on the kernel under JAXHQ_KERNELS=all, the tests' mode) with
    JAXHQ_QUANTIZE_PATH applied: "fp8=kernel,mxfp8=xla", "all=xla" or "act_grad=fp8_block+mxfp8" (comma-separated)."""
    every_kernel = os.environ.get("JAXHQ_KERNELS", "gpu").lower() == "all"
    paths = {f: "kernel" for f in DEFAULT_PATHS} if every_kernel else dict(DEFAULT_PATHS)
    spec = os.environ.get("JAXHQ_QUANTIZE_PATH", "").strip()
    for item in filter(None, (t.strip() for t in spec.split(","))):
        fam, _, path = item.partition("=")
        families = fam == "act_grad" and set(path.split("+")) <= set(FAMILIES)
        if (path not in ("kernel", "xla") and not families) or (fam != "all" and fam not in paths):
            raise ValueError(f"JAXHQ_QUANTIZE_PATH: {item!r} is not FAMILY=kernel|xla with FAMILY in "
                             f"{sorted(paths)} or 'all' (act_grad also takes families joined by '+')")
        paths.update({f: path for f in paths} if fam == "all" else {fam: path})
    return paths


def act_grad_path(q: Quantizer, usage: tuple, size: Optional[int] = None) -> str:
    """How an activation's gradient of `size` elements is quantized with q into `usage`: "kernel" (its copies
    made by one launch from h and dy, where a kernel takes them) or "xla" (the gradient computed first). By
    families ('+'-joined, the default), the launch takes the listed families' gradients of at least
    ACT_GRAD_MIN_ELEMENTS elements (or of an unknown size); "kernel" / "xla" choose for every size."""
    path = quantize_paths()["act_grad"]
    if path in ("kernel", "xla"):
        return path
    large = size is None or size >= ACT_GRAD_MIN_ELEMENTS
    return "kernel" if large and all(side(q, a).name in path.split("+") for a in usage) else "xla"


def copy_path(q: Quantizer, axis: str, platform: str) -> str:
    """How the `axis` copy of `q` is made on `platform` ("cpu" or "cuda"): "kernel" or "xla"."""
    sq = side(normalize(q), axis)
    if platform not in kernel_platforms():
        return "xla"
    return quantize_paths().get(sq.name, "xla")


def _kernel_copies(x2d, q, usage, **kw) -> Optional[dict]:
    if not kernel_platforms():
        return None
    from ..ffi import primitives
    platform = primitives.platform_of(x2d)
    sides = tuple(a for a in usage if copy_path(q, a, platform) == "kernel")
    if not sides:
        return None
    from ..ffi.dispatch import quantize_copies
    return quantize_copies(x2d, q, usage, sides=sides, **kw)


def quantize(x, quantizer: Quantizer, usage: Usage = USAGES, *, key=None, state=None, amax=None,
             transposed: bool = False, cast_to=None, decoded: Usage = ()) -> QTensor:
    """Quantize `x` (rank >= 2, leading dims flattened into rows) into the copies named by `usage`.

    key: jax.random key for stochastic rounding; state: delayed-scaling state (see `init_state`);
    amax: a precomputed (e.g. mesh-reduced) per-tensor amax of x, used by per-tensor formats' copies.
    transposed: x is 2D and the tensor to quantize is x.T; the kernels read x where it lies (the dense op's
    weight: the kernel [in, out] makes the copies of its transpose without a transposed copy in between, so
    XLA can fuse the amax into the cast that produces it). The same copies as quantize(x.T), except that
    stochastic rounding draws other numbers on the kernel path.
    cast_to: quantize x.astype(cast_to) (the dense op's float32 master weight in a bf16 model). From float32 to
    bfloat16 the kernels round each value as they load it, so that cast is never written to memory, except where
    a per-tensor amax is taken first (FP8 current scaling, NVFP4) and not given: XLA's cast then carries the
    amax pass.
    decoded: copies (among `usage`) that a kernel writes as their values, bfloat16, instead of their codes
    (MXFP8 and NVFP4; `Storage.decoded`), for a GEMM that would dequantize them anyway
    (jaxhq.ops.gemm.decoded_copies). The reference path makes codes.
    """
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"quantize needs a Quantizer, got {quantizer!r}")
    check_input(x, quantizer)
    if transposed and x.ndim != 2:
        raise QuantizationError(f"transposed quantization of shape {tuple(x.shape)} with {quantizer}: 2D needed")
    usage = normalize_usage(usage)
    decoded = normalize_usage(decoded) if decoded else ()
    q = normalize(quantizer)
    if isinstance(x, ActivationGrad):
        if transposed or cast_to is not None:
            raise QuantizationError("an activation's gradient is quantized as it is (no transpose or cast)")
        if act_grad_path(q, usage, math.prod(x.shape)) == "kernel":
            with jax.named_scope(QUANTIZE_SCOPE):
                qt = _activation_grad_copies(x, q, usage, key, state, amax, decoded)
            if qt is not None:
                return qt
        x = x.grad()  # the derivative itself is not quantization (outside the scope profiles count as such)
    with jax.named_scope(QUANTIZE_SCOPE):  # profiles attribute these ops to quantization
        return _quantize(x, q, usage, key, state, amax, transposed, cast_to, decoded)


def _activation_grad_copies(g: ActivationGrad, q, usage, key, state, amax, decoded) -> Optional[QTensor]:
    """The copies of g made by one kernel launch from h and dy, or None where no kernel takes them."""
    h2d = jax.lax.stop_gradient(g.h).reshape(-1, g.h.shape[-1])
    dy2d = jax.lax.stop_gradient(g.dy).reshape(-1, g.dy.shape[-1])
    copies = _kernel_copies(h2d, q, usage, key=key, state=state, amax=amax, decoded=decoded, act_grad=(dy2d, g.act))
    if copies is None:
        return None
    return QTensor(rowwise=copies.get(ROWWISE), columnwise=copies.get(COLUMNWISE), shape=tuple(g.shape),
                   dtype=jnp.dtype(g.dtype))


QUANTIZE_SCOPE = "jaxhq_quantize"
STATE_SCOPE = "jaxhq_state"


def _quantize(x, q, usage, key, state, amax, transposed=False, cast_to=None, decoded=()) -> QTensor:
    x = jax.lax.stop_gradient(x)
    x2d = x.reshape(-1, x.shape[-1])
    copies = _kernel_copies(x2d, q, usage, key=key, state=state, amax=amax, transposed=transposed, cast_to=cast_to,
                            decoded=decoded)
    if cast_to is not None:  # the reference's input (unused, so not computed, when the kernels made the copies)
        x, x2d = x.astype(cast_to), x2d.astype(cast_to)
    if transposed:
        x = x2d = x2d.T  # the reference (and the result's shape): the tensor itself
    if copies is not None:
        return QTensor(rowwise=copies.get(ROWWISE), columnwise=copies.get(COLUMNWISE),
                       shape=tuple(x.shape), dtype=jnp.dtype(x.dtype))
    copies = {}
    for axis in usage:
        sq = side(q, axis)
        arr = x2d if axis == ROWWISE else x2d.T
        sq.check_shape(*arr.shape, axis)
        sk = None if key is None else jax.random.fold_in(key, USAGES.index(axis))
        copies[axis] = sq.quantize_2d(arr, axis, key=sk, state=_side_state(q, state, axis), amax=amax)
    return QTensor(rowwise=copies.get(ROWWISE), columnwise=copies.get(COLUMNWISE),
                   shape=tuple(x.shape), dtype=jnp.dtype(x.dtype))


def dequantize(qt: QTensor, axis: Optional[str] = None):
    return qt.dequantize(axis)


@jax.custom_vjp
def _ste(x, y):
    return y


_ste.defvjp(lambda x, y: (y, None), lambda _, g: (g, jnp.zeros_like(g)))


def fake_quantize(x, quantizer: Quantizer, axis: str = ROWWISE, **kw):
    """dequantize(quantize(x)) through one copy, with a straight-through (identity) gradient."""
    y = quantize(x, quantizer, (axis,), **kw).dequantize(axis)
    return _ste(x, y)


__all__ = ["quantize", "dequantize", "fake_quantize", "init_state", "update_state", "normalize",
           "QuantizationError", "ActivationGrad"]
