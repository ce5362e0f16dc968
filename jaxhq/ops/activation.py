"""The MLP activations: forward with jax.nn, and the input gradient as the dense op's backward quantizes it.

`Dense(activation=...)` (the dense op's `activation`) applies one to its GEMM's output. Its backward hands the
gradient's quantization h (the GEMM's output, kept from the forward) and dy instead of the gradient itself
(`formats.ActivationGrad`). Where a kernel takes them and the format's family is on the launch
(formats.quantize.act_grad_path: FP8 blockwise and delayed scaling by default, gradients of 2^26 elements and more),
the gradient's copies come out of one launch and the gradient is never written (csrc/activation.h computes it: exact
float32 on the CPU, the hardware's approximations on the GPU); elsewhere JAX differentiates the forward, as it would
without the op. The two gradients agree within bfloat16 rounding (tests/test_activation.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..ffi import primitives as P
from ..formats import ActivationGrad

# name -> (function, gated): gated activations split their input in halves, act(first half) * second half
ACTIVATIONS = {"gelu": (jax.nn.gelu, False), "silu": (jax.nn.silu, False), "relu": (jax.nn.relu, False),
               "swiglu": (jax.nn.silu, True), "geglu": (jax.nn.gelu, True)}
_KERNEL_IDS = {"gelu": P.ACT_GELU, "silu": P.ACT_SILU, "relu": P.ACT_RELU}


def check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")


def is_gated(activation: str) -> bool:
    check(activation)
    return ACTIVATIONS[activation][1]


def activate(h, activation: str):
    """The activation of h (gated: of its two halves along the last axis)."""
    check(activation)
    fn, gated = ACTIVATIONS[activation]
    if not gated:
        return fn(h)
    a, b = jnp.split(h, 2, axis=-1)
    return fn(a) * b


def kernel_id(activation: str) -> int:
    """The kernels' id of an activation (P.ACT_* | P.GATED)."""
    base = {"swiglu": "silu", "geglu": "gelu"}.get(activation, activation)
    return _KERNEL_IDS[base] | (P.GATED if is_gated(activation) else 0)


def input_grad(h, dy, activation: str) -> ActivationGrad:
    """The gradient of `activate(h)`'s input given its output's gradient dy, as `quantize` takes it."""
    grad = lambda: jax.vjp(lambda t: activate(t, activation), h)[1](dy.astype(h.dtype))[0]  # noqa: E731
    return ActivationGrad(h=h, dy=dy, act=kernel_id(activation), grad=grad)
