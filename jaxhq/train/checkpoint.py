"""Orbax checkpoints of a TrainState: master weights, optimizer state, quantizer state, step and rng key,
plus a JSON sidecar with the recipe name and the model config.

`restore` checks the sidecar and the array shapes before reading anything: a checkpoint of another model
raises an error naming the differing fields or arrays. A checkpoint made under another recipe restores the
weights and optimizer and re-creates the quantizer state for the current recipe (`TrainState.with_recipe`);
under the same recipe the quantizer state must match exactly, and resuming is bit-identical.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import jax
import numpy as np

from .state import TrainState

META = "meta.json"
ARRAYS = "state"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into the given state; the message says what differs."""


def dirname(recipe_name: str) -> str:
    """A directory name for a recipe name ("hybrid:mxfp8:nvfp4" -> "hybrid-mxfp8-nvfp4")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", recipe_name)


def _step_dir(ckdir: str, step: int) -> str:
    return os.path.join(os.path.abspath(ckdir), f"step_{step:08d}")


def steps(ckdir: str) -> list:
    if not os.path.isdir(ckdir):
        return []
    out = []
    for d in os.listdir(ckdir):
        m = re.fullmatch(r"step_(\d+)", d)
        if m and os.path.exists(os.path.join(ckdir, d, META)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_step(ckdir: str) -> Optional[int]:
    s = steps(ckdir)
    return s[-1] if s else None


def _arrays(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "quant_state": state.quant_state, "key": state.key}


def _shapes(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): [list(np.shape(x)), str(np.asarray(x).dtype) if not hasattr(x, "dtype")
                                      else str(x.dtype)] for p, x in flat}


def save(ckdir: str, state: TrainState, extra: Optional[dict] = None) -> str:
    """Write the state at its step under `ckdir/step_N/` and return that path."""
    import shutil

    import orbax.checkpoint as ocp
    path = _step_dir(ckdir, int(state.step))
    partial = path + ".partial"  # written whole, then renamed: a kill mid-save leaves the last checkpoint as it was
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(partial):
        shutil.rmtree(partial)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(partial, ARRAYS), _arrays(state))
    ckptr.wait_until_finished()
    meta = {"step": int(state.step), "recipe": state.recipe.name, "model": dataclasses.asdict(state.model.config),
            "params": _shapes(state.params), "quant_state": _shapes(state.quant_state), **(extra or {})}
    with open(os.path.join(partial, META), "w") as f:
        json.dump(meta, f)
    if os.path.exists(path):  # the same step saved again (a resumed run ending where it started)
        shutil.rmtree(path)
    os.rename(partial, path)
    return path


def read_meta(ckdir: str, step: Optional[int] = None) -> dict:
    step = latest_step(ckdir) if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {ckdir!r}")
    with open(os.path.join(_step_dir(ckdir, step), META)) as f:
        return json.load(f)


def _diff(saved: dict, current: dict) -> list:
    out = []
    for k in sorted(set(saved) | set(current)):
        if saved.get(k) != current.get(k):
            out.append(f"{k}: checkpoint {saved.get(k, 'missing')} vs model {current.get(k, 'missing')}")
    return out


def restore(ckdir: str, state: TrainState, step: Optional[int] = None):
    """(state restored from `ckdir` at `step` (default latest), the sidecar dict). `state` gives the model,
    optimizer and recipe to restore into; see the module docstring for what must match."""
    import orbax.checkpoint as ocp
    meta = read_meta(ckdir, step)
    path = _step_dir(ckdir, meta["step"])
    model_diff = _diff(meta["model"], dataclasses.asdict(state.model.config))
    param_diff = _diff(meta["params"], _shapes(state.params))
    if model_diff or param_diff:
        lines = model_diff[:4] if model_diff else param_diff[:3]
        raise CheckpointError(f"checkpoint {path} is of another model: " + "; ".join(lines))
    same_recipe = meta["recipe"] == state.recipe.name
    if same_recipe and meta["quant_state"] != _shapes(state.quant_state):
        lines = _diff(meta["quant_state"], _shapes(state.quant_state))[:4]
        raise CheckpointError(f"checkpoint {path} was saved under recipe {meta['recipe']!r} but its quantizer "
                              "state does not match this recipe's: " + "; ".join(lines))
    target = _arrays(state)
    ckptr = ocp.StandardCheckpointer()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    if not same_recipe:
        # Restore everything but the quantizer state, which belongs to the old recipe.
        saved = ckptr.metadata(os.path.join(path, ARRAYS))
        saved_tree = getattr(saved, "item_metadata", saved)
        saved_tree = getattr(saved_tree, "tree", saved_tree)
        abstract["quant_state"] = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), dict(saved_tree)["quant_state"])
    try:
        arrays = ckptr.restore(os.path.join(path, ARRAYS), abstract)
    except Exception as e:  # orbax raises several types; keep one clear message
        raise CheckpointError(f"cannot restore {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    new = state.with_params(arrays["params"], step=arrays["step"], opt_state=arrays["opt_state"], key=arrays["key"],
                            quant_state=arrays["quant_state"] if same_recipe else state.quant_state)
    if not same_recipe:
        new = new.with_recipe(state.recipe)
    return new, meta
