"""XLA FFI kernels: loads the `_jaxhq_ffi` extension and registers its targets with JAX.

`available(platform)` says whether the kernels run on "cpu" or "gpu"; when the extension is missing,
one warning is issued and callers use the plain-jnp reference in `jaxhq.formats` (same numerics).
"""
from __future__ import annotations

import functools
import warnings

__all__ = ["available", "load", "registered_targets"]

_WARNED = False


@functools.lru_cache(maxsize=None)
def load():
    """The extension module, or None (with one warning) when it was not built."""
    global _WARNED
    try:
        from . import _jaxhq_ffi  # noqa: F401
        return _jaxhq_ffi
    except ImportError as e:
        if not _WARNED:
            _WARNED = True
            warnings.warn(f"jaxhq: the FFI extension jaxhq.ffi._jaxhq_ffi is not available ({e}); quantization "
                          "runs the plain-jnp reference (same numerics, slower). Reinstall with `pip install .` "
                          "to build it.", RuntimeWarning, stacklevel=2)
        return None


def _has_gpu_backend() -> bool:
    import jax
    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def registered_targets() -> dict:
    """{"cpu": [names], "cuda": [names]}: the targets registered with XLA in this process (registers once)."""
    import jax
    mod = load()
    out = {"cpu": [], "cuda": []}
    if mod is None:
        return out
    regs = mod.registrations()
    for name, cap in regs["cpu"].items():
        jax.ffi.register_ffi_target(name, cap, platform="cpu")
        out["cpu"].append(name)
    if regs["cuda"] and _has_gpu_backend():
        for name, cap in regs["cuda"].items():
            jax.ffi.register_ffi_target(name, cap, platform="CUDA")
            out["cuda"].append(name)
    return out


def available(platform: str = "cpu") -> bool:
    """True when the FFI kernels run on `platform` ("cpu", or "gpu"/"cuda")."""
    p = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(platform.lower())
    if p is None:
        return False
    return bool(registered_targets()[p])


def __getattr__(name):  # lazy: importing jaxhq.ffi does not import jax-heavy modules
    if name in ("primitives", "dispatch", "partitioning"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    if name in ("quantize_copies", "dequantize_storage"):
        from . import dispatch
        return getattr(dispatch, name)
    raise AttributeError(name)
