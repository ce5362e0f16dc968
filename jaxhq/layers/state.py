"""Delayed-scaling state in the Flax collection "quant_state", and the helper that merges it each step.

A layer creates a variable only for a slot whose quantizer is stateful (`Float8DelayedScaling`, or a Hybrid
with a delayed side), named after the slot: quant_state/<module path>/{input, weight, grad_output}.
Forward slots (input, weight) are updated by the forward pass when the collection is mutable
(`apply(..., mutable=["quant_state"])`; never during `init`). The grad_output state cannot be written in the
forward pass (its amax is only known in the backward): the layer passes it into the dense op, whose gradient
w.r.t. that state IS the next state. A train step therefore differentiates w.r.t. the collection too and calls
`merge_quant_state(mutated, grads)`: forward slots from the mutated collection, grad_output from the gradient.

The collection "weight_amax" (optional, read-only) holds max |kernel| of the dense kernels whose weight copies
read a per-tensor amax (FP8 current scaling, NVFP4; `weight_amax_paths`, `weight_amaxes`): where given, those
copies take it instead of a pass over the kernel of their own. A train step computes it from the weights its
optimizer update writes (XLA fuses the reductions into the update), for the next step. Layers never create it:
a "weight_amax" passed to `apply` must be that of the params passed with it.
"""
from __future__ import annotations

import contextvars
import os

import flax.linen as nn
import jax
from flax import traverse_util

from ..formats import init_state
from ..formats.base import abs_max_f32
from ..recipes import DenseQuantizers
from .introspect import model_slots

QUANT_STATE = "quant_state"
WEIGHT_AMAX = "weight_amax"
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


def weight_amaxes(params, paths) -> dict:
    """The "weight_amax" collection of `params` for the modules at `paths` (tuples of scope names, as
    `weight_amax_paths` gives them): max |kernel| as float32 (NaN when the kernel holds one), nested as the params
    are. It belongs to exactly these params: a step that changes them computes it again (jaxhq.train.state does,
    in the jitted step whose update writes them)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({(*p, "kernel"): abs_max_f32(flat[(*p, "kernel")]) for p in paths})


def collection_paths(tree) -> tuple:
    """The module paths a "weight_amax" collection holds (the `paths` of the weight_amaxes that made it)."""
    return tuple(sorted(k[:-1] for k in traverse_util.flatten_dict(tree)))


_READERS: contextvars.ContextVar = contextvars.ContextVar("jaxhq_weight_amax_readers", default=None)


def weight_amax_paths(model, *example_inputs) -> tuple:
    """The scope paths of the modules of `model` whose weight copies read the "weight_amax" collection (traced
    abstractly on `example_inputs`, as `model_slots` traces it): a recipe without per-tensor weight formats has
    none, and no amax is taken."""
    readers: set = set()
    token = _READERS.set(readers)
    try:
        model_slots(model, None, *example_inputs)
    finally:
        _READERS.reset(token)
    return tuple(sorted(readers))


def weight_amax(m: nn.Module, takes: bool):
    """Module m's kernel amax from the "weight_amax" collection where its weight quantizer `takes` one (see
    `weight_amax_paths`), else None; None too when the collection does not hold it, or under JAXHQ_WEIGHT_AMAX=0
    (read at trace time: the layers then reduce their kernels themselves)."""
    if not takes:
        return None
    readers = _READERS.get()
    if readers is not None:
        readers.add(tuple(str(p) for p in m.scope.path))
    if os.environ.get("JAXHQ_WEIGHT_AMAX", "1") == "0" or not m.has_variable(WEIGHT_AMAX, "kernel"):
        return None
    return m.get_variable(WEIGHT_AMAX, "kernel")
