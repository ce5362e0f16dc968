"""Every example runs on the CPU at a tiny size and shows what it claims."""
import importlib.util
import math
import os

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_custom_factory(capsys):
    ex = load("custom_factory")
    out = ex.main("micro", num_layers=3, steps=8, batch_size=2)
    table = capsys.readouterr().out
    rows = {l.split()[0] + " " + l.split()[1]: l for l in table.splitlines() if l.startswith(("layers_", "lm_head"))}
    assert "mxfp8" in rows["layers_0.attn.qkv weight"] and "nvfp4" in rows["layers_1.attn.qkv weight"]
    assert "mxfp8" in rows["layers_2.mlp.fc2 input"] and "mxfp8" in rows["lm_head weight"]
    assert out["val_after"] < out["val_before"] - 0.5
    assert ex.tiny_recipe().quantizer(ex.QuantizerRole("linear", "weight", "layers_1.mlp.fc1")).name == "mxfp8"


def test_hybrid_mxfp8_nvfp4():
    ex = load("hybrid_mxfp8_nvfp4")
    out = ex.main("micro", steps=8, batch_size=2)
    assert out["forward_equal"]  # the forward pass is MXFP8's, bit for bit
    assert out["dw_rel_err_mxfp8"] < out["dw_rel_err_hybrid"] < 0.25  # the NVFP4 backward is coarser but close
    v = out["val_loss"]
    assert abs(v["hybrid:mxfp8:nvfp4"] - v["bf16"]) / v["bf16"] < 0.1


def test_quantize_existing_model():
    ex = load("quantize_existing_model")
    out = ex.main(steps=40, hidden=64)
    assert 0 < out["output_rel_diff"] < 0.1  # quantized, but close to the plain model
    assert out["losses"][-1] < 0.5 * out["losses"][0] and out["accuracy"] > 0.6
    assert all(math.isfinite(l) for l in out["losses"])


def test_sharded_step_on_eight_cpu_devices():
    """In a fresh process (the fake device count must be set before jax starts)."""
    import subprocess
    import sys
    root = os.path.dirname(EXAMPLES)
    env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    code = ("import runpy, json; m = runpy.run_path('examples/sharded_step.py'); "
            "print('RESULT', json.dumps(m['main']('data=2,fsdp=2,tensor=2', 'mxfp8', 'tiny', 2, 8)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["fc1_spec"] == ["fsdp", "tensor"]  # FSDP on embed, tensor parallel on mlp
    np.testing.assert_allclose(out["losses"], out["ref_losses"], rtol=1e-4)
