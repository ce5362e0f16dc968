"""CPU checks of the GEMM dispatch plumbing: the table (jaxhq.ops.gemm) reads without loading the extension,
the kernels module (jaxhq.ffi.gemm) does not import the table, and the MXFP8 kernel choice fails clearly."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhq.ffi import gemm as G
from jaxhq.formats import MXFP8, NVFP4, quantize

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_table_imports_without_the_extension():
    code = ("import sys, importlib; t = importlib.import_module('jaxhq.ops.gemm'); "
            "assert t.lookup('mxfp8', 'mxfp8', 'cpu') is t.dequantized_dot; "
            "print(any('_jaxhq_ffi' in m for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_kernels_module_does_not_import_the_table():
    tree = ast.parse((ROOT / "jaxhq" / "ffi" / "gemm.py").read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [c.args[0].value for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args
              and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)
              and getattr(c.func, "attr", "") == "import_module"]
    assert not [m for m in names if "ops" in m.split(".")], names


def _mx(rows, k, fmt="e4m3"):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, k)), jnp.float32)
    return quantize(x, MXFP8(fmt), "rowwise").rowwise


def test_kernel_choice_errors():
    a, b = _mx(8, 64), _mx(16, 64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        G.blockscaled_gemm(a, b, jnp.float32, kernel="tensor-cores")
    with pytest.raises(G.GemmUnsupported, match="Hopper"):  # this machine has no Hopper GPU
        G.blockscaled_gemm(a, b, jnp.float32, kernel="wgmma")
    with pytest.raises(G.GemmUnsupported, match="multiple of 16"):
        G.blockscaled_gemm(_mx(8, 40), _mx(16, 40), jnp.float32, kernel="wgmma")
    n = quantize(jnp.ones((8, 64), jnp.float32), NVFP4(), "rowwise").rowwise
    with pytest.raises(G.GemmUnsupported, match="Hopper"):  # the NVFP4 kernel (decoded on chip) too
        G.blockscaled_gemm(n, n, jnp.float32, kernel="wgmma")
    with pytest.raises(G.GemmUnsupported, match="no kernel for"):
        G.blockscaled_gemm(n, a, jnp.float32, kernel="wgmma")
