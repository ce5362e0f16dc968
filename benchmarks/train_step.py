"""One training step of a GPT-style stack under each recipe, against bf16 from the same run.

For every recipe: the jitted forward + backward + AdamW step as the training loop runs it (state.logged_train_step:
state and loss log donated, the batch cut on the device, so XLA replays its CUDA graphs), timed after warm-up,
--steps steps dispatched back to back (median of 3 such windows; `step_sync_ms`, the median with a device sync
after every step, adds the host's dispatch time to each step); tokens/s; model FLOP utilisation (6 N T
for the dense layers plus 6 L B S^2 d for causal attention, over the GPU's dense bf16 peak); the compiled program's
memory (arguments + temporaries + outputs - donated aliases); and where the time goes, from a profile of the
compiled step itself (step_profile.py): quantization (with any producer XLA fused into it), GEMMs, attention, the
rest, the idle gap (the time between a step's kernels in a profile of the timed CUDA-graph executable run back to
back), and kernels per step. --paths runs each quantized recipe with the quantization made by the FFI kernels or by
XLA's fusion of the reference (JAXHQ_QUANTIZE_PATH), to choose the default per format. --rounds R > 1 times every
recipe R - 1 times more after all have run, in turn, every other round in reverse order (a fresh state each time,
warmed up for as many steps as are timed), so clock and power drift during the run, and what the recipe before left
the card in, hit all recipes alike: step_ms is then the median over the rounds and vs_bf16 the median of each
round's ratio. The JSON is written after the first pass and again after every round, so a run cut short keeps what
it timed (`meta.rounds_done`, `meta.final`); --budget-s also stops the rounds.

    python benchmarks/train_step.py                    # on a GPU, the H100 preset: d 4096, FFN 14336 gated, 32 heads, seq 4096
    python benchmarks/train_step.py --preset quick     # a smaller stack for a quick look
    python benchmarks/train_step.py --preset small     # the main job's small model (d 512, 6 layers)
"""
from __future__ import annotations

import functools
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environ, parser, path_env, print_table, write_json  # noqa: E402
from step_profile import CATEGORIES, NO_GRAPHS, device_busy, profile_step  # noqa: E402

from jaxhq.train import model as M, state as S  # noqa: E402
from jaxhq.train.run import LOSS_LOG  # noqa: E402

RECIPES = ["bf16", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "hybrid:mxfp8:nvfp4"]
PRESETS = {  # config, batch size
    "h100": (M.GPTConfig(num_layers=2, d_model=4096, num_heads=32, d_ff=14336, seq_len=4096, dtype="bfloat16"), 2),
    "quick": (M.GPTConfig(num_layers=2, d_model=1024, num_heads=8, d_ff=3584, seq_len=1024, dtype="bfloat16"), 4),
    "small": (M.preset("small"), 16),  # the main job's `jaxhq train --model small` (its default batch)
    "cpu": (M.GPTConfig(num_layers=1, d_model=128, num_heads=4, d_ff=256, seq_len=64, dtype="float32"), 2),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}  # dense bf16 FLOP/s of the SXM parts


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def step_flops(cfg: M.GPTConfig, batch: int) -> float:
    tokens = batch * cfg.seq_len
    dense_params = sum(fin * fout for _, fin, fout, n in dense_shapes(cfg) for _ in range(n))
    return 6.0 * dense_params * tokens + 6.0 * cfg.num_layers * batch * cfg.seq_len ** 2 * cfg.d_model


def dense_shapes(cfg: M.GPTConfig) -> list:
    """(name, in, out, count) of the model's dense ops, from its parameters."""
    model = M.GPT(cfg, S.named_recipe("bf16"))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), M.example_tokens(cfg, 1)))
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(shapes["params"]))[0]
    out = {}
    for path, leaf in flat:
        keys = [str(getattr(k, "key", k)) for k in path]
        if keys[-1] != "kernel":
            continue
        fin, fout = leaf.shape
        name = "/".join(k for k in keys[:-1] if not k.startswith("layers_"))
        out.setdefault((name, fin, fout), 0)
        out[(name, fin, fout)] += 1
    return [(n, fi, fo, c) for (n, fi, fo), c in out.items()]


def run_recipe(name: str, cfg: M.GPTConfig, batch: int, steps: int, warmup: int, split: bool,
               path: str = "default") -> dict:
    """Compiles and times one recipe's step; with `split`, profiles it (step_profile). `path` is a
    JAXHQ_QUANTIZE_PATH value ("default": as the library chooses) or "env:NAME=VALUE" (another switch read at
    trace time, e.g. env:JAXHQ_DECODED=0), set while the step is traced."""
    jax.clear_caches()
    with environ(path_env(path, "JAXHQ_QUANTIZE_PATH")):
        row, window = _run(name, cfg, batch, steps, warmup, split)
        return row | {"path": path}, window


def _run(name: str, cfg: M.GPTConfig, batch: int, steps: int, warmup: int, split: bool):
    """(row, window): window() times `steps` more steps from a fresh state (the later rounds)."""
    recipe = S.named_recipe(name)
    model = M.GPT(cfg, recipe)
    tx = S.make_optimizer(1e-4, 1000, 10)
    state = S.create(model, tx)
    # The loop's step (state.logged_train_step): the batch cut on the device from a token array (one window per
    # row here, the same windows every step), the loss written into a donated log; its buffers stay in place.
    tokens = jax.random.randint(jax.random.key(3), (batch * (cfg.seq_len + 1),), 0, cfg.vocab_size).astype(jnp.uint8)
    starts = (jnp.arange(batch, dtype=jnp.int32) * (cfg.seq_len + 1))[None]
    log = [jnp.zeros(LOSS_LOG, jnp.float32)]  # the loss log each call donates and gets back
    step = S.logged_train_step
    t0 = time.perf_counter()
    compiled = step.lower(state, log[0], tokens, starts, cfg.seq_len, None).compile()
    compile_s = time.perf_counter() - t0

    def call(exe, st):
        """One step of the executable exe: (the next state, the loss log, which holds this step's loss)."""
        st, log[0] = exe(st, log[0], tokens, starts)
        return st, log[0]
    mem = compiled.memory_analysis()
    mem_bytes = None
    if mem is not None:
        mem_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                     - mem.alias_size_in_bytes)
    for _ in range(warmup):
        state, m = call(compiled, state)
        jax.block_until_ready(m)
    timed = compiled  # (`compiled` becomes the profiled build below)

    def back_to_back_n(st, n):
        """`n` steps dispatched back to back from st, waited for: the state after them."""
        for _ in range(n):
            st, out = call(timed, st)
        jax.block_until_ready(out)
        return st

    def back_to_back(st):
        """`steps` steps dispatched back to back from st: (the state after them, seconds per step)."""
        t = time.perf_counter()
        st = back_to_back_n(st, steps)
        return st, (time.perf_counter() - t) / steps

    def window() -> float:  # a later round: a fresh state, warmed up as long as it is timed
        st = S.create(model, tx)
        for _ in range(max(warmup, steps)):
            st, _ = call(timed, st)
        return back_to_back(jax.block_until_ready(st))[1]

    # step_ms: steps dispatched back to back, as the training loop runs them (the host queues the next step
    # while the device runs this one; jaxhq.train reads the loss every 10 steps), median of 3 such windows.
    # step_sync_ms: each step waited for, so the host's dispatch time adds to every step.
    windows = []
    for _ in range(3):
        state, w = back_to_back(state)
        windows.append(w)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = call(compiled, state)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_s = float(np.median(windows))
    row = dict(recipe=name, step_ms=1e3 * step_s, step_sync_ms=1e3 * float(np.median(times)),
               tokens_per_s=batch * cfg.seq_len / step_s,
               memory_gib=None if mem_bytes is None else mem_bytes / 2 ** 30, compile_s=compile_s,
               loss=float(m[(int(state.step) - 1) % m.shape[0]]))
    peak = peak_flops()
    row["mfu"] = None if peak is None else step_flops(cfg, batch) / step_s / peak
    if split:  # profiled on a compile without CUDA graphs, so each op shows (step_profile.NO_GRAPHS)
        n_prof, holder = min(steps, 5), [state]  # the state the profiled steps carry on

        def timed_steps():  # back to back, as timed: the device's idle time between the step's kernels
            holder[0] = back_to_back_n(holder[0], n_prof)

        busy = device_busy(timed_steps, n_prof)
        opts = NO_GRAPHS if jax.default_backend() == "gpu" else {}
        try:
            compiled = step.lower(holder[0], log[0], tokens, starts, cfg.seq_len, None).compile(compiler_options=opts)
        except Exception as e:  # noqa: BLE001 - an XLA without the option: profile the graphs as they are
            row["profile_note"] = f"graphs kept: {type(e).__name__}"

        def one_step():
            holder[0], out = call(compiled, holder[0])
            jax.block_until_ready(out)

        prof = profile_step(one_step, n_prof, compiled.as_text(), step_s, busy)
        row.update(prof)
        for c in CATEGORIES:
            if f"{c}_ms" in prof:
                row[f"{c}_share"] = prof[f"{c}_ms"] / (1e3 * step_s)
    return row, window


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: h100 on a GPU, else cpu")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-split", action="store_true", help="skip the profile of the step (time per category)")
    p.add_argument("--paths", default="default",
                   help="JAXHQ_QUANTIZE_PATH values to run each quantized recipe under, ';'-separated "
                        "(e.g. 'default;all=xla;all=kernel'), or env:NAME=VALUE (e.g. 'default;env:JAXHQ_DECODED=0')")
    p.add_argument("--budget-s", type=float, default=None, help="start no new recipe after this many seconds")
    p.add_argument("--rounds", type=int, default=1, help="timing rounds over all recipes (see above)")
    a = p.parse_args()
    preset = "quick" if a.quick else a.preset or ("cpu" if jax.default_backend() == "cpu" else "h100")
    cfg, batch = PRESETS[preset]
    cfg = cfg.replace(num_layers=a.layers or cfg.num_layers)
    batch = a.batch or batch
    print(f"model: {cfg.num_layers} layers, d {cfg.d_model}, FFN {cfg.d_ff} ({cfg.activation}), {cfg.num_heads} heads, "
          f"seq {cfg.seq_len}, batch {batch}, {cfg.num_params() / 1e9:.2f} B params; {jax.devices()[0].device_kind}")
    rows, windows, t_start, skipped = [], [], time.perf_counter(), []
    runs = [(n, p) for n in a.recipes.split(",") for p in (["default"] if n == "bf16" else a.paths.split(";"))]
    for name, path in runs:
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
            skipped.append(f"{name} ({path})")
            continue
        r, window = run_recipe(name, cfg, batch, a.steps, a.warmup, not a.no_split, path)
        r["step_ms_rounds"] = [r["step_ms"]]
        rows.append(r)
        windows.append(window)
        shares = "  ".join(f"{c} {r[c + '_ms']:.2f}" for c in CATEGORIES if c + "_ms" in r)
        print(f"  {name} [{path}]: {r['step_ms']:.2f} ms  ({shares}; idle {r.get('idle_ms', 0):.2f}; "
              f"kernels/step {r.get('kernels_per_step')}) {r.get('profile_error', '')}", flush=True)
        print(f"    top ops: {r.get('top_ops')}", flush=True)
        print("    kernels by origin: " + ", ".join(f"{c}/{o} {n:g}" for c, o, n in r.get("kernels_by_origin", [])),
              flush=True)

    def save(final: bool) -> str:  # after the first pass and every round: a run cut short keeps what it timed
        summarize(rows, cfg, batch)
        return write_json("train_step", rows, a.out, config=dict(cfg.__dict__), batch=batch, skipped=skipped,
                          rounds_done=len(rows[0]["step_ms_rounds"]) if rows else 0, final=final)

    save(final=False)
    for i in range(1, a.rounds):  # every recipe again, in turn
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
            print(f"  rounds stopped after {i} (time budget)", flush=True)
            break
        for r, window in list(zip(rows, windows))[::-1 if i % 2 else 1]:  # each recipe after others in turn
            r["step_ms_rounds"].append(1e3 * window())
        print(f"  round {i}: " + "  ".join(f"{r['recipe']} {r['step_ms_rounds'][-1]:.2f}" for r in rows), flush=True)
        save(final=False)
    out = save(final=True)
    print_table(rows, ["recipe", "path", "step_ms", "vs_bf16", "sync_vs_bf16", "tokens_per_s", "mfu", "memory_gib",
                       "memory_vs_bf16", "quantize_share", "gemm_share", "attention_share", "rest_share", "compile_s"])
    if skipped:
        print("skipped (time budget):", ", ".join(skipped))
    print("wrote", out)


def summarize(rows: list, cfg: M.GPTConfig, batch: int) -> None:
    """Each row's step time (median over its rounds), throughput, MFU and ratios to bf16 (median of the rounds'
    ratios), from the rounds timed so far."""
    base = next((r for r in rows if r["recipe"] == "bf16"), None)
    for r in rows:
        r["step_ms"] = float(np.median(r["step_ms_rounds"]))
        r["tokens_per_s"] = batch * cfg.seq_len / (r["step_ms"] / 1e3)
        if r.get("mfu") is not None:
            r["mfu"] = step_flops(cfg, batch) / (r["step_ms"] / 1e3) / peak_flops()
        if base:
            r["vs_bf16"] = float(np.median([t / b for t, b in zip(r["step_ms_rounds"], base["step_ms_rounds"])]))
            r["sync_vs_bf16"] = r["step_sync_ms"] / base["step_sync_ms"]
            if r["memory_gib"] and base["memory_gib"]:
                r["memory_vs_bf16"] = r["memory_gib"] / base["memory_gib"]


if __name__ == "__main__":
    main()
