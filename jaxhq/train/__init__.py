"""The main job: a byte-level GPT on the embedded corpus, its train state, checkpoints and training loop."""
from . import data, model, state
from .model import GPT, PRESETS, GPTConfig, preset
from .state import (TrainState, create, donated_train_step, eval_step, evaluate, logged_train_step, make_optimizer,
                    train_step)

__all__ = ["data", "model", "state", "GPT", "GPTConfig", "PRESETS", "preset", "TrainState", "create",
           "donated_train_step", "eval_step", "evaluate", "logged_train_step", "make_optimizer", "train_step"]
