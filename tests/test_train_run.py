"""The training loop: report.json, loss.png, the table, and resuming a run from its checkpoint."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhq.train import run as R


def cfg(tmp_path, **kw):
    base = dict(recipe="mxfp8", compare=("bf16",), steps=6, model="micro", batch_size=2, warmup=2, eval_every=3,
                eval_batches=1, smooth=2, out=str(tmp_path / "out"), progress=False)
    return R.RunConfig(**{**base, **kw})


def test_run_writes_report_plot_and_table(tmp_path):
    lines = []
    rep = R.run(cfg(tmp_path), echo=lines.append)
    with open(tmp_path / "out" / "report.json") as f:
        saved = json.load(f)
    assert set(saved["runs"]) == {"mxfp8", "bf16"} and saved["baseline"] == "bf16"
    m, b = saved["runs"]["mxfp8"], saved["runs"]["bf16"]
    assert [s for s, _ in m["train_curve"]] == list(range(6)) and [s for s, _ in m["val_curve"]] == [3, 6]
    assert m["final_train_loss"] == np.mean([l for _, l in m["train_curve"][-2:]])
    assert m["final_val_loss"] == m["val_curve"][-1][1]
    assert m["val_gap_pct"] == 100 * (m["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"]
    assert abs(m["val_gap_pct"]) < 5  # six steps of mxfp8 stay close to bf16
    png = tmp_path / "out" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000
    text = "\n".join(lines)
    assert "mxfp8" in text and f"{m['val_gap_pct']:+.2f}%" in text and rep["table"] in text
    assert m["speed_vs_baseline"] == m["tokens_per_s"] / b["tokens_per_s"]  # timed: six steps, one after the first
    assert "speed vs bf16" in text and f"{m['speed_vs_baseline']:.2f}x" in text


def test_resume_continues_the_curve(tmp_path):
    full = R.run(cfg(tmp_path, compare=(), out=str(tmp_path / "a")), echo=lambda *_: None)["runs"]["mxfp8"]
    ck = str(tmp_path / "ck")
    R.run(cfg(tmp_path, compare=(), steps=3, checkpoint_dir=ck, out=str(tmp_path / "b")), echo=lambda *_: None)
    resumed = R.run(cfg(tmp_path, compare=(), checkpoint_dir=ck, resume=True, out=str(tmp_path / "c")),
                    echo=lambda *_: None)["runs"]["mxfp8"]
    assert resumed["start_step"] == 3
    assert resumed["train_curve"] == full["train_curve"]  # bit-identical losses after the resume
    assert resumed["final_val_loss"] == full["final_val_loss"]


def test_throughput_leaves_out_compilation_evaluation_and_saving():
    """tokens/s on a made-up clock: the first logged block (compilation) is not timed, pauses are left out."""
    now = [0.0]
    t = R._Throughput(100, clock=lambda: now[0])
    with t.pause(None):  # before the first block: nothing is timed yet
        now[0] = 4.0
    now[0] = 5.0
    assert np.isnan(t.logged(10))  # steps 0-9, with compilation
    now[0] = 6.0
    assert t.logged(20) == 10 * 100 / 1.0
    with t.pause(None):  # 3 s evaluating
        now[0] = 9.0
    now[0] = 10.0
    assert t.logged(30) == 20 * 100 / (5.0 - 3.0)
    assert np.isnan(R._Throughput(100, clock=lambda: 1.0).logged(5))


def test_loop_reads_each_block_of_losses_one_block_late(tmp_path, monkeypatch):
    """The loop reads a block of 10 losses only after the next block is dispatched (so the device queue never runs
    empty at a read), and every queued step before an evaluation, a checkpoint or the end; the curve is complete."""
    dispatched, reads = [0], []
    step_fn, get = R._state.logged_train_step, R.jax.device_get

    def counting_step(*args):
        dispatched[0] += 1
        return step_fn(*args)

    def spy_get(x):
        if getattr(x, "shape", None) == (R.LOSS_LOG,):  # the loop's reads of its loss log
            reads.append(dispatched[0])
        return get(x)

    monkeypatch.setattr(R._state, "logged_train_step", counting_step)
    monkeypatch.setattr(R.jax, "device_get", spy_get)
    rep = R.run(cfg(tmp_path, recipe="bf16", compare=(), steps=45, eval_every=25), echo=lambda *_: None)
    # steps 0-9 read once 10-19 are queued; the evaluations after steps 25 and 45 drain the queue (at 35 the only
    # queued block, 25-34, is the newest one: it waits): 10-19 and 20-24 at 25, 25-34 and 35-44 at 45
    assert reads == [20, 25, 25, 45, 45]
    assert [s for s, _ in rep["runs"]["bf16"]["train_curve"]] == list(range(45))


def test_loop_losses_are_the_steps_losses(tmp_path, monkeypatch):
    """The losses the loop logs on the device are those train_step returns for the same batches (the loop's step
    cuts its batches on the device: the same windows as data.train_batch, across chunks of window starts, here of
    5 steps). Two programs (the loop's donated step
    with its batch cut inside, and train_step), which XLA may fuse differently: float32 roundings apart, a few
    ulps of the loss after twelve steps; rtol 1e-6 is about 10 float32 ulps at these losses (5-6)."""
    from jaxhq.train import data as D, model as M, state as S
    monkeypatch.setattr(R, "STARTS_CHUNK", 5)
    c = cfg(tmp_path, recipe="bf16", compare=(), steps=12, eval_every=0)
    rep = R.run(c, echo=lambda *_: None)["runs"]["bf16"]
    mc = M.preset("micro")
    ds = D.load(D.DataConfig(batch_size=2, seq_len=mc.seq_len))
    st = S.create(M.GPT(mc, S.named_recipe("bf16")), S.make_optimizer(c.lr, c.steps, c.warmup))
    want = []
    for i in range(12):
        st, m = S.train_step(st, ds.train_batch(i))
        want.append(float(m["loss"]))
    np.testing.assert_allclose([l for _, l in rep["train_curve"]], want, rtol=1e-6)


def test_loop_stops_on_a_nan_loss_within_two_blocks(tmp_path, monkeypatch):
    """A NaN loss from step 12 on: the loop raises once it reads that block, one block late (at the 30th dispatch),
    naming the first step whose loss is not finite."""
    dispatched = [0]
    step_fn = R._state.logged_train_step

    def nan_from_12(st, log, *args):
        dispatched[0] += 1
        step = int(st.step)
        st, log = step_fn(st, log, *args)
        return st, (log.at[step % R.LOSS_LOG].set(jnp.nan) if dispatched[0] > 12 else log)

    monkeypatch.setattr(R._state, "logged_train_step", nan_from_12)
    with pytest.raises(FloatingPointError, match="recipe bf16: loss is nan at step 12"):
        R.run(cfg(tmp_path, recipe="bf16", compare=(), steps=60, eval_every=0), echo=lambda *_: None)
    assert dispatched[0] == 30


def test_loop_on_a_mesh_cuts_sharded_batches(tmp_path):
    """With a mesh (two CPU devices, data=2) the loop's step (its batch cut on the devices, constrained to the
    batch's sharding) gives the unsharded run's losses (the same command on the CPU without the mesh) up to the
    order of the split reductions (the loss's mean over the batch and the gradients' sums over two halves:
    float32 roundings, a few ulps a step; 1e-5 leaves room for six steps of them)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}

    def curve(name, *mesh):
        out = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "jaxhq", "train", "--model", "micro", "--steps", "6", "--batch-size",
                            "2", "--eval-every", "3", "--recipe", "bf16", "--compare", *mesh, "--out", str(out),
                            "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out / "report.json") as f:
            return json.load(f)["runs"]["bf16"]["train_curve"]

    sharded, plain = curve("mesh", "--mesh", "data=2"), curve("plain")
    assert [s for s, _ in sharded] == list(range(6))
    np.testing.assert_allclose([l for _, l in sharded], [l for _, l in plain], rtol=1e-5)
