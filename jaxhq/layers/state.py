"""Delayed-scaling state in the Flax collection "quant_state", and the helper that merges it each step.

A layer creates a variable only for a slot whose quantizer is stateful (`Float8DelayedScaling`, or a Hybrid
with a delayed side), named after the slot: quant_state/<module path>/{input, weight, grad_output}.
Forward slots (input, weight) are updated by the forward pass when the collection is mutable
(`apply(..., mutable=["quant_state"])`; never during `init`). The grad_output state cannot be written in the
forward pass (its amax is only known in the backward): the layer passes it into the dense op, whose gradient
w.r.t. that state IS the next state. A train step therefore differentiates w.r.t. the collection too and calls
`merge_quant_state(mutated, grads)`: forward slots from the mutated collection, grad_output from the gradient.
"""
from __future__ import annotations

import flax.linen as nn
import jax

from ..formats import init_state
from ..recipes import DenseQuantizers

QUANT_STATE = "quant_state"
SLOTS = ("input", "weight", "grad_output")
FORWARD_SLOTS = ("input", "weight")
BACKWARD_SLOT = "grad_output"


def dense_state_vars(m: nn.Module, qs: DenseQuantizers, prefix: str = "") -> dict:
    """{slot: flax Variable} for the stateful slots of one GEMM (none for stateless quantizers)."""
    out = {}
    for slot in SLOTS:
        q = getattr(qs, slot)
        if q.stateful:
            out[slot] = m.variable(QUANT_STATE, prefix + slot, init_state, q)
    return out


def values(state_vars: dict):
    """The current values to pass as the op's `states` (None when no slot is stateful)."""
    return {k: v.value for k, v in state_vars.items()} or None


def write_forward(m: nn.Module, state_vars: dict, new: dict) -> None:
    """Store the forward slots' next states when "quant_state" is mutable (and not while initializing)."""
    if not state_vars or m.is_initializing() or not m.is_mutable_collection(QUANT_STATE):
        return
    for slot in FORWARD_SLOTS:
        if slot in state_vars and new.get(slot) is not None:
            state_vars[slot].value = new[slot]


def _is_backward(path) -> bool:
    return any(getattr(p, "key", getattr(p, "name", None)) == BACKWARD_SLOT for p in path)


def merge_quant_state(forward_state, grad_state):
    """The next "quant_state": grad_output entries from `grad_state` (the gradient w.r.t. the collection, which
    the dense op sets to the next state), everything else from `forward_state` (the mutated collection)."""
    return jax.tree_util.tree_map_with_path(lambda p, f, g: g if _is_backward(p) else f, forward_state,
                                            grad_state)
