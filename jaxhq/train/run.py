"""The training loop of `jaxhq train`: one run per recipe on the same data order, a progress bar, the table,
report.json and loss.png.

Every recipe starts from the same initial weights (same seed) and sees the same batches, so the gap to the
bf16 baseline measures the recipe alone. "final train loss" is the mean of the last `smooth` steps; "final
validation loss" is measured on fixed validation batches after the last step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

import jax
import numpy as np

from .. import recipes as _recipes
from . import data as _data
from . import model as _model
from . import state as _state


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Options of one `jaxhq train` invocation (the CLI flags one to one)."""

    recipe: str = "mxfp8"
    compare: tuple = ("bf16",)
    steps: int = 300
    model: str = "tiny"
    seq_len: Optional[int] = None  # None: the preset's
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    smooth: int = 20
    out: str = "jaxhq_out"
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False
    mesh: Optional[str] = None
    remat: str = "none"
    progress: bool = True


@dataclasses.dataclass
class RunResult:
    """Curves and final figures of one recipe."""

    recipe: str
    train_curve: list = dataclasses.field(default_factory=list)  # [step, loss]
    val_curve: list = dataclasses.field(default_factory=list)  # [step, loss]
    final_train_loss: float = math.nan
    final_val_loss: float = math.nan
    tokens_per_s: float = math.nan  # training alone: compilation, evaluation and checkpoints left out
    seconds: float = 0.0
    start_step: int = 0


def recipe_label(recipe) -> str:
    return recipe.name if isinstance(recipe, _recipes.CustomRecipe) else str(recipe)


def _progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True,
                file=sys.stderr, bar_format="{desc}: {percentage:3.0f}%|{bar}| step {n}/{total} "
                                            "[{elapsed}<{remaining}{postfix}]")


class Stopped(Exception):
    """SIGTERM or SIGINT arrived during training: the step in flight finished, a checkpoint was saved (when a
    checkpoint directory was given) and the run ends; `--resume` continues it bit for bit."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """Turns SIGTERM/SIGINT into a flag the loop reads after each step (a preempted job keeps its progress)."""
    got = []
    handler = lambda signum, frame: got.append(signum)  # noqa: E731
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def train_recipe(recipe, cfg: RunConfig, dataset: _data.Dataset, model_config: _model.GPTConfig,
                 mesh=None) -> RunResult:
    """Train one recipe for cfg.steps (resuming from cfg.checkpoint_dir when asked) and measure it."""
    from . import checkpoint as _ckpt
    rec = _state.named_recipe(recipe)
    res = RunResult(rec.name)
    model = _model.GPT(model_config, rec)
    tx = _state.make_optimizer(cfg.lr, cfg.steps, cfg.warmup)
    st = _state.create(model, tx, cfg.seed)
    ckdir = None if cfg.checkpoint_dir is None else os.path.join(cfg.checkpoint_dir, _ckpt.dirname(rec.name))
    if cfg.resume and ckdir is not None and _ckpt.latest_step(ckdir) is not None:
        st, meta = _ckpt.restore(ckdir, st)
        res.train_curve = [list(p) for p in meta.get("train_curve", [])]
        res.val_curve = [list(p) for p in meta.get("val_curve", [])]
        print(f"jaxhq train: {rec.name}: resuming from step {int(st.step)} ({ckdir})", file=sys.stderr)
    elif cfg.resume:
        print(f"jaxhq train: {rec.name}: no checkpoint in {ckdir}; starting from step 0", file=sys.stderr)
    from .sharded import mesh_context, shard_train_state
    if mesh is not None:
        st = shard_train_state(st, mesh)
    start = int(st.step)
    res.start_step = start
    with mesh_context(mesh), _stop_on_signals() as signals:
        res = _loop(st, start, rec, cfg, dataset, mesh, res, ckdir, signals)
    return res


class _Throughput:
    """Training tokens/s: timed from the end of the first logged block (which holds compilation) to the end of the
    latest one, less the time the loop spent evaluating or saving in between. A pause first waits for the steps
    already queued on the device, so their time counts as training."""

    def __init__(self, tokens_per_step: int, clock=time.perf_counter):
        self.tokens, self.clock = tokens_per_step, clock
        self.t0, self.first, self.paused = None, 0, 0.0

    def logged(self, steps_done: int) -> float:
        """After a block's losses were read: tokens/s so far (nan until a block after the first)."""
        now = self.clock()
        if self.t0 is None:
            self.t0, self.first = now, steps_done
            return math.nan
        n = steps_done - self.first
        return n * self.tokens / (now - self.t0 - self.paused) if n else math.nan

    @contextlib.contextmanager
    def pause(self, state):
        """Leave what runs inside out of the timing (after the first logged block; before it, nothing is timed)."""
        if self.t0 is None:
            yield
            return
        jax.block_until_ready(state)
        t = self.clock()
        try:
            yield
        finally:
            self.paused += self.clock() - t


LOSS_LOG = 16  # the losses the loop's step keeps on the device (more than the 10 of a block it reads at once)
STARTS_CHUNK = 1024  # the steps whose batches' window starts are on the device at once (a new table per chunk)
# A copy of the log, read while the steps after it overwrite the log ("+ 0": a jitted identity hands back its
# input array itself, which the next step's donation would delete).
_snapshot = jax.jit(lambda log: log + 0.0)


def _loop(st, start, rec, cfg, dataset, mesh, res, ckdir, signals=()):
    from . import checkpoint as _ckpt
    from .sharded import batch_sharding, shard_batch

    val = [b if mesh is None else shard_batch(b, mesh) for b in dataset.val_batches(cfg.eval_batches)]
    # The train split goes to the device once, the window starts of the steps a chunk at a time; the step cuts its
    # batch there and logs its loss into `log` (state.logged_train_step), so its inputs and outputs keep their
    # addresses (XLA records its graphs again only when a new chunk of starts arrives).
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda a: jax.device_put(a, replicated)  # noqa: E731
    tokens, log, starts = place(dataset.train), place(np.zeros(LOSS_LOG, np.float32)), None
    sharding = None if mesh is None else batch_sharding(mesh)
    throughput = _Throughput(dataset.tokens_per_batch)
    bar = _progress(cfg.steps, start, rec.name, cfg.progress)
    pending, unread, t0 = [], None, time.perf_counter()  # unread: (steps, log snapshot) of the block before

    def read(steps, snap):  # the losses of these steps, from a snapshot of the log taken after the last of them
        logged = jax.device_get(snap)
        res.train_curve += [[s, float(logged[s % LOSS_LOG])] for s in steps]
        rate = throughput.logged(steps[-1] + 1)
        if math.isfinite(rate):
            res.tokens_per_s = rate
        bar.set_postfix_str(f"loss {res.train_curve[-1][1]:.4f}, "
                            f"{rate if math.isfinite(rate) else 0:,.0f} tok/s", refresh=False)
        bad = next(((s, l) for s, l in res.train_curve[-len(steps):] if not math.isfinite(l)), None)
        if bad:
            bar.close()
            raise FloatingPointError(f"recipe {rec.name}: loss is {bad[1]} at step {bad[0]}")

    for step in range(start, cfg.steps):
        if starts is None or step % STARTS_CHUNK == 0:  # rows step % STARTS_CHUNK of the chunk holding this step
            starts = place(dataset.train_starts_table(step - step % STARTS_CHUNK, STARTS_CHUNK))
        st, log = _state.logged_train_step(st, log, tokens, starts, dataset.config.seq_len, sharding)
        pending.append(step)
        stop = bool(signals)
        last = step == cfg.steps - 1
        save = ckdir is not None and (last or stop or
                                      (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0))
        eval_now = cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last)
        if last or save or stop or eval_now:  # the state is read next: every queued step is waited for
            if unread:
                read(*unread)
            read(pending, _snapshot(log))
            unread, pending = None, []
        elif len(pending) >= 10:
            # Reading the newest block's losses would wait for the device to finish every step queued so far,
            # and each block would then start on an empty device queue: read the block before it instead.
            snap = _snapshot(log)
            if unread:
                read(*unread)
            unread, pending = (pending, snap), []
        if eval_now:
            with throughput.pause(st):
                res.val_curve.append([step + 1, _state.evaluate(st, val)])
        if save:
            with throughput.pause(st):
                _ckpt.save(ckdir, st, extra={"train_curve": res.train_curve, "val_curve": res.val_curve})
        bar.update(1)
        if stop and not last:
            bar.close()
            name = signal.Signals(signals[0]).name
            where = f"checkpoint saved in {ckdir}; continue with --resume" if ckdir else \
                "no --checkpoint-dir, so nothing was saved"
            raise Stopped(signals[0], f"{name}: {rec.name} stopped after step {step + 1}; {where}")
    bar.close()
    res.seconds = time.perf_counter() - t0
    tail = [l for _, l in res.train_curve[-cfg.smooth:]]
    res.final_train_loss = float(np.mean(tail)) if tail else math.nan
    res.final_val_loss = res.val_curve[-1][1] if res.val_curve and res.val_curve[-1][0] == cfg.steps else \
        _state.evaluate(st, val)
    return res


def gap_pct(value: float, base: float) -> float:
    return 100.0 * (value - base) / base


def speed_ratio(r: RunResult, base: RunResult) -> float:
    """r's training tokens/s over the baseline's (nan where either was not timed)."""
    return r.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else math.nan


def table(results: list, baseline: Optional[str]) -> str:
    """The final table: train and validation loss per recipe, the validation gap to the baseline, tokens/s and
    its ratio to the baseline's."""
    base = next((r for r in results if r.recipe == baseline), None)
    head = ("recipe", "train loss", "val loss", f"val vs {baseline}" if base else "", "tokens/s",
            f"speed vs {baseline}" if base else "")
    rows = []
    for r in results:
        gap = "" if base is None or r is base else f"{gap_pct(r.final_val_loss, base.final_val_loss):+.2f}%"
        speed = "" if base is None or r is base else f"{speed_ratio(r, base):.2f}x"
        rows.append((r.recipe, f"{r.final_train_loss:.4f}", f"{r.final_val_loss:.4f}", gap,
                     f"{r.tokens_per_s:,.0f}" if math.isfinite(r.tokens_per_s) else "-", speed))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def plain_log_labels(axis) -> None:
    """Tick labels of a log axis as plain numbers ("2", "3.5"), not "2x10^0"."""
    from matplotlib import ticker
    fmt = ticker.FuncFormatter(lambda v, _: f"{v:.3g}")
    axis.set_major_formatter(fmt)
    axis.set_minor_formatter(fmt)


def plot(results: list, path: str, title: str = "") -> str:
    """loss.png: the train curve (thin) and validation points (markers) of every recipe, headless."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, r in enumerate(results):
        color = f"C{i}"
        if r.train_curve:
            s, l = np.array(r.train_curve).T
            ax.plot(s + 1, l, color=color, lw=0.8, alpha=0.6, label=f"{r.recipe} train")
        if r.val_curve:
            s, l = np.array(r.val_curve).T
            ax.plot(s, l, "o-", color=color, lw=1.8, ms=4, label=f"{r.recipe} val ({r.final_val_loss:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / byte)")
    ax.set_title(title)
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def report(results: list, cfg: RunConfig, model_config: _model.GPTConfig, dataset: _data.Dataset,
           baseline: Optional[str]) -> dict:
    base = next((r for r in results if r.recipe == baseline), None)
    runs = {}
    for r in results:
        d = dataclasses.asdict(r)
        if base is not None and r is not base:
            d["val_gap_pct"] = gap_pct(r.final_val_loss, base.final_val_loss)
            d["train_gap_pct"] = gap_pct(r.final_train_loss, base.final_train_loss)
            d["speed_vs_baseline"] = speed_ratio(r, base)
        runs[r.recipe] = d
    dev = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"{dev.platform} ({getattr(dev, 'device_kind', dev.platform)}) x{jax.device_count()}",
            "jax": jax.__version__, "config": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_config),
            "num_params": model_config.num_params(), "tokens_per_step": dataset.tokens_per_batch,
            "train_bytes": int(len(dataset.train)), "val_bytes": int(len(dataset.val)), "baseline": baseline,
            "runs": runs}


def run(cfg: RunConfig, recipes: Optional[list] = None, mesh=None, echo=print) -> dict:
    """Train every recipe (cfg.recipe, then cfg.compare), print the table, write report.json and loss.png."""
    model_config = _model.preset(cfg.model).replace(remat=cfg.remat)
    if cfg.seq_len:
        model_config = model_config.replace(seq_len=cfg.seq_len)
    dataset = _data.load(_data.DataConfig(batch_size=cfg.batch_size, seq_len=model_config.seq_len, seed=cfg.seed))
    recipes = recipes if recipes is not None else [cfg.recipe, *cfg.compare]
    results, seen = [], set()
    for r in recipes:
        rec = _state.named_recipe(r)
        if rec.name in seen:
            continue
        seen.add(rec.name)
        results.append(train_recipe(rec, cfg, dataset, model_config, mesh))
    baseline = next((c for c in cfg.compare if c in seen), None) if cfg.compare else None
    rep = report(results, cfg, model_config, dataset, baseline)
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    png = plot(results, os.path.join(cfg.out, "loss.png"),
               f"{cfg.model} GPT, {cfg.steps} steps, {rep['device']}")
    echo("")
    echo(table(results, baseline))
    echo(f"\nreport: {os.path.join(cfg.out, 'report.json')}\nplot:   {png}")
    rep["table"] = table(results, baseline)
    return rep
