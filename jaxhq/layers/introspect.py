"""Which roles a model uses: trace it abstractly (`jax.eval_shape` of `init`) while every jaxhq layer (and every
Dense/Einsum intercepted by `quantize_model`) reports its slots, then keep the roles in call order, once each.

The record is a context variable set only for the duration of `model_roles`, so layers cost nothing otherwise.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax

from ..recipes import CustomRecipe
from ..roles import QuantizerRole

_RECORD: contextvars.ContextVar = contextvars.ContextVar("jaxhq_slot_record", default=None)


def record(path: str, slots) -> None:
    """Called by a layer with its slot list; a no-op unless `recording()` is active."""
    rec = _RECORD.get()
    if rec is not None:
        rec.append((path, tuple(slots)))


@contextlib.contextmanager
def recording():
    """Collect (module path, slots) of every layer called inside the block."""
    rec: list = []
    token = _RECORD.set(rec)
    try:
        yield rec
    finally:
        _RECORD.reset(token)


def model_slots(model, recipe: Optional[CustomRecipe], *example_inputs, rngs=None) -> list:
    """[(module path, slots)] of `model` traced abstractly on `example_inputs` under `recipe` (a model with a
    `recipe` field is cloned with it, so shape errors of that recipe show up here)."""
    if recipe is not None and hasattr(model, "recipe") and hasattr(model, "clone"):
        model = model.clone(recipe=recipe)
    rngs = rngs or {"params": jax.random.key(0), "quant": jax.random.key(1), "dropout": jax.random.key(2)}
    with recording() as rec:
        jax.eval_shape(lambda: model.init(rngs, *example_inputs))
    return rec


def model_roles(model, recipe: Optional[CustomRecipe], *example_inputs) -> list:
    """Every role of every quantized slot of `model`, each once, grouped by module in call order (boundary
    slots without a consumer role are left out)."""
    return roles_of(model_slots(model, recipe, *example_inputs))


def roles_of(rec: list) -> list:
    """model_roles of a model_slots record."""
    seen, out = set(), []
    for own in (True, False):  # each module's own roles first, in call order; then any wired-only role
        for path, slots in rec:
            for s in slots:
                if isinstance(s.role, QuantizerRole) and s.role not in seen and (s.role.name == path) == own:
                    seen.add(s.role)
                    out.append(s.role)
    return out
