"""The NNX example (examples/nnx_bridge.py): jaxhq layers bridged into Flax NNX train, and under fp8_delayed the
forward and backward delayed-scaling histories advance once per step."""
import importlib.util
import pathlib

import numpy as np
from flax import nnx

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nnx_bridge.py"


def _load():
    spec = importlib.util.spec_from_file_location("nnx_bridge_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nnx_bridge_example_trains_and_keeps_delayed_state():
    ex = _load()
    losses, _ = ex.main("mxfp8", steps=3)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    losses, model = ex.main("fp8_delayed", steps=3)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    hist = {k[:-1]: np.asarray(v.get_value()) for k, v in nnx.state(model.block).flat_state()
            if k[-1] == "amax_history"}
    assert {k[-1] for k in hist} == {"input", "weight", "grad_output"}
    for k, h in hist.items():  # history_len 1024: exactly `steps` entries filled, newest first
        assert np.all(h[:3] > 0) and np.all(h[3:] == 0), k
