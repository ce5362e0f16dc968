"""Where a jitted step's device time goes, from a profile of the step itself (not re-timings of its pieces).

Each instruction of the compiled HLO gets a category: quantize (the jaxhq quantize/amax custom calls, and
every op or fusion holding an op from jaxhq.formats.quantize's named scope, the XLA path's fused quantization
included), gemm (dots, cuBLAS/cuBLASLt and jaxhq GEMM custom calls), attention (cuDNN fused attention, and ops
traced inside an attention module), collective, or rest. The profiler's device events name their HLO op, so
their durations add up per category. The idle gap comes from a second profile, of steps run back to back as they
are timed (inside XLA's CUDA graphs, where the kernels still show, without their HLO op): the time between the
first kernel's start and the last one's end in which no kernel, memset or copy runs, per step. Neither the
categories' sum nor that profile's span equals the timed step exactly: the runs differ in clocks by a few percent.
"""
from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

import jax

from jaxhq.formats.quantize import QUANTIZE_SCOPE, STATE_SCOPE

CATEGORIES = ("quantize", "gemm", "attention", "collective", "rest")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "ragged-all-to-all")


def _opcode(rhs: str) -> str:
    """The opcode of an HLO instruction's right-hand side ("f32[2]{0} fusion(...)" -> "fusion")."""
    m = re.search(r"\s([a-z][\w\-]*)\(", " " + rhs.split(", metadata=")[0])
    return m.group(1) if m else ""


def _own_category(rhs: str) -> str | None:
    op = _opcode(rhs)
    target = re.search(r'custom_call_target="([^"]+)"', rhs)
    target = target.group(1).lower() if target else ""
    op_name = re.search(r'op_name="([^"]+)"', rhs)
    op_name = op_name.group(1) if op_name else ""
    if "jaxhq_quantize" in target or "jaxhq_amax" in target:
        return "quantize"
    if "fmha" in target or "flash" in target:
        return "attention"
    if op in ("dot", "convolution") or "gemm" in target or "matmul" in target or "cublas" in target:
        return "gemm"
    if any(op.startswith(c) for c in _COLLECTIVE):
        return "collective"
    if QUANTIZE_SCOPE in op_name:
        return "quantize"
    if "attention" in op_name.lower():
        return "attention"
    return None


_WRAPPERS = ("jit(", "jvp(", "transpose(", "vmap(", "checkpoint", "remat", "pjit(", "custom_")


def origin(rhs: str) -> str:
    """Where an instruction comes from, in a few words: a custom call's target, else the last op of its
    op_name (what the fusion's root computes) under the jaxhq scope it was traced in, if any."""
    target = re.search(r'custom_call_target="([^"]+)"', rhs)
    if target:
        return target.group(1)
    op_name = re.search(r'op_name="([^"]+)"', rhs)
    parts = [p for p in (op_name.group(1) if op_name else "").split("/") if p and not p.startswith(_WRAPPERS)]
    scope = next((p for p in parts if p in (QUANTIZE_SCOPE, STATE_SCOPE)), None)
    last = parts[-1] if parts else _opcode(rhs)
    return f"{scope}:{last}" if scope else last


def origins(hlo_text: str) -> dict:
    """{instruction name: origin} for every instruction of the HLO text."""
    return {m.group(1): origin(m.group(2)) for m in map(_INST.match, hlo_text.splitlines()) if m}


def describe(hlo_text: str) -> dict:
    """{instruction name: its result shape and opcode (custom calls: their target), then its operands' shapes
    (a GEMM's K, a quantize fusion's input are only there)}, to name the top ops."""
    out, shapes, args = {}, {}, {}
    for line in hlo_text.splitlines():
        m = _INST.match(line)
        if m:
            rhs = m.group(2).split(", metadata=")[0]
            target = re.search(r'custom_call_target="([^"]+)"', rhs)
            shape = rhs.split(" ")[0] if not rhs.startswith("(") else rhs[:rhs.find(")") + 1]
            shapes[m.group(1)] = re.sub(r"\{[\d,]*\}", "", shape)
            args[m.group(1)] = re.findall(r"%([\w.\-]+)", rhs[len(shape):].split("), ")[0])
            out[m.group(1)] = f"{shape[:90]} {target.group(1) if target else _opcode(rhs)}"
    for name in out:
        out[name] += " <- " + " ".join(shapes.get(a, "?") for a in args[name])[:200]
    return out


def categorize(hlo_text: str) -> dict:
    """{instruction name: category} for every instruction of a compiled module's HLO text; a fusion (or any
    call) takes the strongest category of the instructions it calls (gemm > attention > quantize)."""
    own, calls, current = {}, {}, None
    comp_cats = collections.defaultdict(set)
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = _INST.match(line)
        if not m or current is None:
            continue
        name, rhs = m.group(1), m.group(2)
        cat = _own_category(rhs)
        own[name] = cat
        called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", rhs)
        calls[name] = called
        if cat:
            comp_cats[current].add(cat)
    order = ("gemm", "attention", "quantize", "collective")
    out = {}
    for name, cat in own.items():
        cats = {cat} if cat else set()
        for c in calls.get(name, ()):
            cats |= comp_cats.get(c, set())
        out[name] = next((c for c in order if c in cats), "rest")
    return out


def _planes(xspace: bytes) -> tuple:
    """(device planes, host CPU planes) of a serialized XSpace, parsed once (no device planes on the CPU backend)."""
    from jax.profiler import ProfileData
    planes = list(ProfileData.from_serialized_xspace(xspace).planes)  # an iterator: read it once
    return [p for p in planes if p.name.startswith("/device:")], [p for p in planes if p.name == "/host:CPU"]


def _device_events(xspace: bytes):
    """(hlo op name, duration ns, is_kernel) of the device planes' op events (or kernel events when the
    profile has no per-op line), from a serialized XSpace."""
    ops, kernels, layout = [], [], []
    device, host = _planes(xspace)
    planes = device or host  # the CPU backend's thunks
    for plane in planes:
        for line in plane.lines:
            layout.append(f"{plane.name}/{line.name}")
            for e in line.events:
                stats = dict(e.stats)
                hlo = stats.get("hlo_op") or (e.name if line.name == "XLA Ops" else None)
                if hlo is None:
                    continue
                hlo = str(hlo).lstrip("%").split(" ")[0].split("=")[0]
                (ops if line.name == "XLA Ops" else kernels).append((hlo, e.duration_ns))
    return ops, kernels, layout


NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}  # compiler options: every op its own launch (see below)


def _trace(run, steps: int) -> bytes:
    """The serialized XSpace (xplane.pb) of a profile of `steps` calls of run(), or b"" when none was written."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return b""
        with open(files[-1], "rb") as f:
            data = f.read()
    return data


def device_busy(run_steps, steps: int) -> tuple | None:
    """(busy, span) in ms per step from a profile of run_steps(), which runs `steps` steps back to back: busy is the
    union of the intervals of every kernel, memset and copy on the device streams, span the time from the step's
    first one's start to its last one's end (the medians over the steps); None where the profile has no device
    streams (the CPU backend). Steps run one after another, so with the same number of events each, the events in
    start order fall into `steps` runs of that many; the host's gaps between steps (which the profiler lengthens at
    small step times) are then not counted. With an uneven count, the whole profile over `steps`."""
    data = _trace(run_steps, 1)
    if not data:
        return None
    spans = [(e.start_ns, e.start_ns + e.duration_ns) for p in _planes(data)[0] for line in p.lines
             if line.name.startswith("Stream") for e in line.events]
    if not spans:
        return None
    return per_step(spans, steps)


def per_step(spans, steps: int) -> tuple:
    """(busy, span) in ms per step of `steps` steps' device intervals [start, end) ns (see device_busy)."""
    spans = sorted(spans)
    per = len(spans) // steps if len(spans) % steps == 0 else 0
    runs = [spans[i * per:(i + 1) * per] for i in range(steps)] if per else [spans]
    n = 1 if per else steps
    busy = sorted(covered_ns(r) / n for r in runs)
    span = sorted((max(b for _, b in r) - r[0][0]) / n for r in runs)
    return busy[len(busy) // 2] / 1e6, span[len(span) // 2] / 1e6


def covered_ns(spans) -> int:
    """The length of the union of [start, end) intervals: overlapping events (streams side by side) count once."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def profile_step(run_step, steps: int, hlo_text: str, step_s: float, busy: tuple | None = None) -> dict:
    """Profiles `steps` calls of run_step() (each synchronised) and splits the device time per category.

    On a GPU, compile the profiled step with NO_GRAPHS: inside a CUDA graph (XLA's command buffers) the
    profiler reports the graph as one op, which hides what it holds.

    busy: (busy, span) per step of the timed executable (device_busy): idle_ms is span - busy; without it, the wall
    time minus this profile's device time.

    Returns {category}_ms per step, kernels per step (per category), device_ms, idle_ms, the
    slowest ops, the quantize and GEMM ops with their operand shapes, and every op (`all_ops`).
    """
    cats = categorize(hlo_text)
    data = _trace(run_step, steps)
    if not data:
        return {"profile_error": "no xplane.pb written"}
    ops, kernels, layout = _device_events(data)
    events = ops or kernels
    if not events:
        return {"profile_error": "no device events with an HLO op; lines: " + ", ".join(layout[:12])}
    ms = dict.fromkeys(CATEGORIES, 0.0)
    n_kernels = dict.fromkeys(CATEGORIES, 0)
    for hlo, dur in events:
        ms[cats.get(hlo, "rest")] += dur / 1e6 / steps
    for hlo, _ in kernels or ops:
        n_kernels[cats.get(hlo, "rest")] += 1
    device_ms = sum(ms.values())
    per_op = collections.Counter()
    for hlo, dur in events:
        per_op[hlo] += dur / 1e6 / steps
    out = {f"{c}_ms": v for c, v in ms.items()}
    out["top_ops"] = [(h, cats.get(h, "?"), round(t, 3)) for h, t in per_op.most_common(12)]
    # kernels per step by category and origin: where each launch of the step comes from
    where = origins(hlo_text)
    by_origin = collections.Counter((cats.get(h, "rest"), where.get(h, "?")) for h, _ in (kernels or ops))
    out["kernels_by_origin"] = [(c, o, n / steps) for (c, o), n in by_origin.most_common(24)]
    desc = describe(hlo_text)
    out["top_quantize_ops"] = [(h, desc.get(h, "?"), round(t, 3)) for h, t in per_op.most_common()
                               if cats.get(h) == "quantize"][:16]
    out["gemm_ops"] = [(h, desc.get(h, "?"), round(t, 4)) for h, t in per_op.most_common() if cats.get(h) == "gemm"]
    # every op of the step: (HLO name, category, what it is with its operands' shapes, ms per step), slowest first
    out["all_ops"] = [(h, cats.get(h, "?"), desc.get(h, "?"), round(t, 4)) for h, t in per_op.most_common()]
    idle = 1e3 * step_s - device_ms if busy is None else busy[1] - busy[0]
    out.update(device_ms=device_ms, idle_ms=max(idle, 0.0),
               kernels_per_step={c: v / steps for c, v in n_kernels.items()},
               unmatched_ops=len({h for h, _ in events if h not in cats}))
    if busy is not None:
        out.update(busy_ms=busy[0], span_ms=busy[1])
    return out
