"""Train state: fp32 master weights under optax, delayed-scaling state, and the jitted train and eval steps.

The model's quantizers read the master weights each step; the "quant_state" collection (amax histories and scales of
delayed-scaling slots) is part of the state, and so is "weight_amax": max |kernel| of the dense kernels whose weight
copies read a per-tensor amax (FP8 current scaling, NVFP4; jaxhq.layers.weight_amax_paths), computed where the
weights are written (at creation and restore, and by each train step from its optimizer update, into which XLA fuses
the reductions), so those copies need no pass over the kernels of their own. A train step merges two sources of its
next value: the forward slots (input, weight) come back as mutated variables, the grad_output slots as their
gradient (the dense op's "the gradient is the new state"). An eval step reads the state and changes nothing, so
train and eval steps can alternate freely. Stochastic rounding draws from the "quant" stream, folded with the step.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from .. import recipes as _recipes
from ..layers.state import (QUANT_STATE, WEIGHT_AMAX, collection_paths, merge_quant_state, weight_amax_paths,
                            weight_amaxes)
from ..recipes import CustomRecipe
from . import data as _data



@struct.dataclass
class TrainState:
    """Everything a run needs to continue: step, master params, optimizer and quantizer state, the rng key, and
    `weight_amax` (jaxhq.layers.weight_amaxes of `params` for the kernels whose copies read one; derived, so not
    checkpointed; `with_params` replaces params and keeps the two together).

    `model` (a Flax module holding the recipe) and `tx` (the optax optimizer) are static.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    quant_state: Any
    key: jax.Array
    weight_amax: Any
    model: nn.Module = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def recipe(self) -> CustomRecipe:
        return self.model.recipe

    def with_recipe(self, recipe) -> "TrainState":
        """The same weights and optimizer under another recipe, with fresh delayed-scaling state where the new
        recipe keeps one (every quantized copy is made again from the master weights by the next step)."""
        model = self.model.clone(recipe=recipe if isinstance(recipe, CustomRecipe) else named_recipe(recipe))
        qs = init_quant_state(model, self.params)
        return self.replace(model=model, quant_state=qs, weight_amax=_model_weight_amaxes(model, self.params))

    def with_params(self, params, **fields) -> "TrainState":
        """The state with other params (and any other `fields`), their kernels' amaxes computed again."""
        return self.replace(params=params, weight_amax=_weight_amaxes(params, collection_paths(self.weight_amax)),
                            **fields)


def cross_entropy(logits, targets):
    """Mean next-token cross entropy in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@functools.lru_cache(maxsize=64)
def named_recipe(spec) -> CustomRecipe:
    """A recipe by name, the same object for the same name, so jitted steps compiled for it are reused."""
    return _recipes.get(spec)


@functools.lru_cache(maxsize=64)
def make_optimizer(lr: float = 3e-3, steps: int = 300, warmup: int = 30, weight_decay: float = 0.1,
                   clip: float = 1.0, b2: float = 0.95) -> optax.GradientTransformation:
    """AdamW on the fp32 master weights with linear warmup, cosine decay to lr/10, global-norm clipping.
    Cached: equal arguments give the same object (a static part of the state, so jit caches hit)."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2), lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, b1=0.9, b2=b2,
                                                                      weight_decay=weight_decay))


def _example(model, batch_size: int = 1):
    return jnp.zeros((batch_size, model.config.seq_len), jnp.int32)


def init_quant_state(model: nn.Module, params) -> dict:
    """The initial "quant_state" collection of `model` (empty when no slot is stateful)."""
    k = jax.random.key(0)
    shapes = jax.eval_shape(_init, model, k, k)
    if QUANT_STATE not in shapes:
        return {}
    return _commit(_init(model, k, k)[QUANT_STATE])


def _commit(tree):
    """Arrays committed to the default device, like restored ones, so a restored state reuses compiled steps."""
    return jax.device_put(tree, jax.devices()[0])


_weight_amaxes = jax.jit(weight_amaxes, static_argnums=1)


def _model_weight_amaxes(model, params):
    """The "weight_amax" collection of `params` for the kernels whose copies read one under model's recipe."""
    return _weight_amaxes(params, weight_amax_paths(model, _example(model)))


@functools.partial(jax.jit, static_argnums=0)
def _init(model, pkey, qkey):
    return model.init({"params": pkey, "quant": qkey}, _example(model))


def create(model: nn.Module, tx: optax.GradientTransformation, seed: int = 0) -> TrainState:
    """A fresh state: parameters from `seed` (the same for every recipe of one model), optimizer state, quantizer
    state, and the key of the "quant" stream."""
    pkey, qkey = jax.random.split(jax.random.key(seed))
    variables = _init(model, pkey, qkey)
    params = nn.meta.unbox(variables["params"])
    arrays = dict(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                  quant_state=variables.get(QUANT_STATE, {}), key=jax.random.key_data(qkey),
                  weight_amax=_model_weight_amaxes(model, params))
    return TrainState(**_commit(arrays), model=model, tx=tx)


def step_key(state: TrainState):
    return jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)


def _variables(params, quant_state, weight_amax=None):
    out = {"params": params, QUANT_STATE: quant_state} if quant_state else {"params": params}
    return {**out, WEIGHT_AMAX: weight_amax} if weight_amax else out


def loss_and_grads(state: TrainState, batch: dict):
    """(loss, next quant_state, grads) of one batch, without touching the optimizer."""
    rngs = {"quant": step_key(state)}

    def loss_fn(params, qs):
        logits, mut = state.model.apply(_variables(params, qs, state.weight_amax), batch["inputs"],
                                        deterministic=False, rngs=rngs, mutable=[QUANT_STATE])
        return cross_entropy(logits, batch["targets"]), mut.get(QUANT_STATE, {})

    (loss, fwd_qs), (grads, grad_qs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.params, state.quant_state)
    return loss, merge_quant_state(fwd_qs, grad_qs) if state.quant_state else {}, grads


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _train_step(state: TrainState, batch: dict):
    loss, qs, grads = loss_and_grads(state, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, quant_state=qs,
                        weight_amax=weight_amaxes(params, collection_paths(state.weight_amax)))  # fused: the update
    return new, {"loss": loss, "grad_norm": global_norm(grads)}


def _eval_step(state: TrainState, batch: dict):
    logits = state.model.apply(_variables(state.params, state.quant_state, state.weight_amax), batch["inputs"],
                               deterministic=True, rngs={"quant": step_key(state)})
    return {"loss": cross_entropy(logits, batch["targets"])}


train_step: Callable = jax.jit(_train_step)
train_step.__doc__ = "One optimizer step on a batch {inputs, targets}: (state, batch) -> (state, {loss, grad_norm})."
donated_train_step: Callable = jax.jit(_train_step, donate_argnums=0)
donated_train_step.__doc__ = ("train_step writing the new state into the buffers of the state it is given, which is "
                              "consumed (use the one returned): the state is held once, not twice. (The run loop runs "
                              "logged_train_step, which also keeps its batch and loss on the device.)")


def _logged_train_step(state: TrainState, log, tokens, starts, seq_len: int, sharding=None):
    batch = _data.windows(tokens, starts[state.step % starts.shape[0]], seq_len)
    if sharding is not None:
        batch = jax.lax.with_sharding_constraint(batch, sharding)
    new, metrics = _train_step(state, batch)
    return new, log.at[state.step % log.shape[0]].set(metrics["loss"])


logged_train_step: Callable = jax.jit(_logged_train_step, static_argnums=(4, 5), donate_argnums=(0, 1))
logged_train_step.__doc__ = (
    "The run loop's step: (state, log, tokens, starts, seq_len[, sharding]) -> (state, log). The batch is cut on "
    "the device (data.windows of the token array `tokens` at `starts[state.step % len(starts)]`, rows of "
    "data.train_starts_table; `sharding`: the batch's) and the loss goes into log[state.step % len(log)]. "
    "State and log are donated and the other arguments stay the same arrays, so the step's inputs and outputs "
    "keep their device addresses from one step to the next and XLA replays its CUDA graphs as recorded; a new "
    "batch or metrics array every step makes it record them again, which took the host longer than the "
    "device's step (docs/training.md).")
eval_step: Callable = jax.jit(_eval_step)
eval_step.__doc__ = "Validation loss of a batch; reads the state and leaves it unchanged: (state, batch) -> {loss}."


def evaluate(state: TrainState, batches: list) -> float:
    """Mean validation loss over a fixed list of batches."""
    losses = [eval_step(state, b)["loss"] for b in batches]
    return float(jnp.mean(jnp.stack(losses)))
