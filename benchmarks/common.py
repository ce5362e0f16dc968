"""Shared helpers for the benchmarks: argument parsing, JSON output, a printed table, device timing."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import time

import jax


def path_env(path: str, plain: str = None) -> dict:
    """The environment a --paths entry sets while its step is traced: none for "default", NAME=VALUE for
    "env:NAME=VALUE" (a switch read at trace time, e.g. env:JAXHQ_DQ_GROUPED=host); any other entry is the value
    of the variable `plain` names (train_step: JAXHQ_QUANTIZE_PATH), where one is named."""
    if path == "default":
        return {}
    if path.startswith("env:"):
        name, eq, value = path[4:].partition("=")
        if eq and name:
            return {name: value}
    elif plain:
        return {plain: path}
    raise SystemExit(f"--paths: {path!r} is neither 'default' nor env:NAME=VALUE")


@contextlib.contextmanager
def environ(values: dict = None):
    """Environment variables set for the duration, then restored (jaxhq reads some when a step is traced,
    the FFI handlers when a call runs). No values: nothing is set."""
    values = values or {}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="JSON file to write (default: benchmarks/results/<name>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    return p


def write_json(name: str, rows: list, out: str | None = None, **extra) -> str:
    out = out or os.path.join(os.path.dirname(__file__), "results", f"{name}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    meta = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version()}
    with open(out, "w") as f:
        json.dump({"meta": meta | extra, "rows": rows}, f, indent=2)
    return out


def print_table(rows: list, columns: list) -> None:
    cells = [[c for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def time_fn(fn, *args, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of fn(*args), synchronised on the device after each call."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def time_back_to_back(fn, *args, iters: int = 10, reps: int = 5):
    """(median seconds per call, per-rep seconds): `iters` asynchronous calls back to back per rep, synchronised
    at the ends, so launch gaps are hidden as in a training step."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return sorted(times)[len(times) // 2], times


def as_launched(t):
    """t, or a Storage with its scales as the quantize launch wrote them (ffi.dispatch.launch_scales: 1x128 and
    MXFP8 ones [blocks, rows]): how a training step hands them to the GEMMs, so under jit XLA cancels the swaps
    (timed as Storages, the launch would carry XLA's transposes)."""
    from jaxhq.ffi.dispatch import launch_scales, rows_inner_scales
    from jaxhq.formats import Storage
    if isinstance(t, Storage) and rows_inner_scales(t):
        return dataclasses.replace(t, scale_inv=launch_scales(t))
    return t
