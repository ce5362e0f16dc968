"""CPU checks of the GEMM dispatch plumbing: the table (jaxhq.ops.gemm) reads without loading the extension,
the kernels module (jaxhq.ffi.gemm) does not import the table, and the MXFP8 / NVFP4 kernel choice (which fails
clearly, and which decides whether the quantize kernels write decoded copies)."""
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


def test_wgmma_choice_per_family(monkeypatch):
    """On a Hopper (faked here) "auto" takes each family's wgmma kernel only when its WINS flag or its variable
    (JAXHQ_MXFP8_GEMM / JAXHQ_NVFP4_GEMM) asks for it, the NVFP4 kernel only where it applies (dense, K % 32 == 0),
    and one family's variable leaves the other's choice alone."""
    monkeypatch.setattr(G, "_hopper", lambda: True)
    nv, mx = G.FMT_NVFP4, G.FMT_MX_E4M3
    for var in ("JAXHQ_MXFP8_GEMM", "JAXHQ_NVFP4_GEMM"):
        monkeypatch.delenv(var, raising=False)
    assert not G._use_wgmma(nv, nv, 256, 256, "auto", "t") and not G._use_wgmma(mx, mx, 256, 256, "auto", "t")
    assert G._use_wgmma(nv, nv, 256, 256, "wgmma", "t") and not G._use_wgmma(nv, nv, 256, 256, "dequantize", "t")
    monkeypatch.setenv("JAXHQ_NVFP4_GEMM", "wgmma")
    assert G._use_wgmma(nv, nv, 256, 256, "auto", "t") and not G._use_wgmma(mx, mx, 256, 256, "auto", "t")
    assert not G._use_wgmma(nv, nv, 256, 48, "auto", "t")  # K % 32 != 0: the dequantize path
    with pytest.raises(G.GemmUnsupported, match="multiple of 32"):
        G._use_wgmma(nv, nv, 256, 48, "wgmma", "t")
    with pytest.raises(G.GemmUnsupported, match="dense"):
        G._use_wgmma(nv, nv, 256, 256, "wgmma", "t", groups=4)
    assert not G._use_wgmma(nv, nv, 256, 256, "auto", "t", groups=4)
    monkeypatch.setenv("JAXHQ_NVFP4_GEMM", "sometimes")
    with pytest.raises(ValueError, match="JAXHQ_NVFP4_GEMM"):
        G._use_wgmma(nv, nv, 256, 256, "auto", "t")
    monkeypatch.delenv("JAXHQ_NVFP4_GEMM")
    monkeypatch.setattr(G, "NVFP4_WGMMA_WINS", True)
    assert G._use_wgmma(nv, nv, 256, 256, "auto", "t") and not G._use_wgmma(mx, mx, 256, 256, "auto", "t")


def test_wgmma_kernels_keep_codes(monkeypatch):
    """Where a family's GEMMs run on its wgmma kernel (which reads codes) the quantize kernels write that family's
    codes, not decoded copies; the other family's copies stay decoded."""
    import importlib
    table = importlib.import_module("jaxhq.ops.gemm")  # the module, not the function jaxhq.ops.gemm
    monkeypatch.setattr(table, "_decoding_gemm", lambda mode: True)
    nv, mx = NVFP4(), MXFP8("e4m3")
    monkeypatch.delenv("JAXHQ_MXFP8_GEMM", raising=False)
    monkeypatch.delenv("JAXHQ_NVFP4_GEMM", raising=False)
    assert table.decoded_copies(nv, ("rowwise",)) == ("rowwise",) == table.decoded_copies(mx, ("rowwise",))
    monkeypatch.setenv("JAXHQ_NVFP4_GEMM", "wgmma")
    assert table.decoded_copies(nv, ("rowwise",)) == () and table.decoded_copies(mx, ("rowwise",)) == ("rowwise",)
    monkeypatch.setenv("JAXHQ_MXFP8_GEMM", "wgmma")
    assert table.decoded_copies(mx, ("rowwise",)) == ()


def test_cutlass_grouped_choice(monkeypatch):
    """Which grouped FP8 calls take CUTLASS's kernels: "auto" where they are built and apply (per-tensor scales, or
    1x128 A and 128x128 B scales without fast accumulation; E4M3 weights, bf16 out, no bias, K % 16, N % 8) and
    CUTLASS_GROUPED_WINS says they win, "cutlass" or an error naming why not, "wgmma" and "cublaslt" never. Faked
    here: a Hopper with the CUTLASS target registered."""
    from jaxhq.formats import Float8Block, Float8CurrentScaling
    rng = np.random.default_rng(0)
    q = lambda shape, fmt="e4m3": quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32),  # noqa: E731
                                           Float8CurrentScaling(fmt), "rowwise").rowwise
    a, b = q((64, 128)), q((32, 128))
    choose = lambda *args, kernel="auto": G._fp8_grouped_cutlass(*args, kernel, "t")  # noqa: E731
    with pytest.raises(G.GemmUnsupported, match="no CUDA GPU|built without CUTLASS|Hopper"):  # this machine: neither
        choose(a, b, 32, 128, 4, jnp.bfloat16, None, kernel="cutlass")
    assert not choose(a, b, 32, 128, 4, jnp.bfloat16, None)
    monkeypatch.setattr(G, "_hopper", lambda: True)
    monkeypatch.setattr(G, "_cuda_targets", lambda: [G.FP8_CUTLASS_GROUPED])
    assert choose(a, b, 32, 128, 4, jnp.bfloat16, None) and choose(a, b, 32, 128, 4, jnp.bfloat16, None,
                                                                     kernel="cutlass")
    assert not choose(a, b, 32, 128, 4, jnp.bfloat16, None, kernel="wgmma")
    assert not choose(a, b, 32, 128, 4, jnp.bfloat16, None, kernel="cublaslt")
    unfit = [((a, b, 32, 128, 4, jnp.float32, None), "float32 output"),
             ((a, b, 32, 128, 4, jnp.bfloat16, jnp.zeros((4, 32))), "bias"),
             ((a, q((32, 128), "e5m2"), 32, 128, 4, jnp.bfloat16, None), "E5M2 weights"),
             ((a, b, 36, 128, 4, jnp.bfloat16, None), "N = 36"),
             ((a, b, 32, 128, 2000, jnp.bfloat16, None), "2000 groups")]
    blk = lambda block, rows: quantize(jnp.ones((rows, 128), jnp.float32), Float8Block(block),  # noqa: E731
                                       "rowwise").rowwise
    assert choose(blk((1, 128), 64), blk((128, 128), 32), 32, 128, 4, jnp.bfloat16, None)
    unfit.append(((blk((1, 128), 64), blk((1, 128), 32), 32, 128, 4, jnp.bfloat16, None), "1x128 weight scales"))
    for args, why in unfit:
        assert not choose(*args), why
        with pytest.raises(G.GemmUnsupported, match=why):
            choose(*args, kernel="cutlass")
    fast = lambda *args: G._fp8_grouped_cutlass(*args, "auto", "t", fast_accum=True)  # noqa: E731
    assert fast(a, b, 32, 128, 4, jnp.bfloat16, None)
    assert not fast(blk((1, 128), 64), blk((128, 128), 32), 32, 128, 4, jnp.bfloat16, None)
    monkeypatch.setattr(G, "CUTLASS_GROUPED_WINS", False)
    assert not choose(a, b, 32, 128, 4, jnp.bfloat16, None)
    assert choose(a, b, 32, 128, 4, jnp.bfloat16, None, kernel="cutlass")
