"""A long run on a bad day: `jaxhq train` checks its output paths before training, reports expected errors in
one line (exit 2), says when --resume finds nothing, stops on SIGTERM with a checkpoint that --resume continues
bit for bit, and a kill during a checkpoint write leaves the previous checkpoint intact. The CLI cases run the
real entry point (`python -m jaxhq`) in a subprocess."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxhq import recipes
from jaxhq.roles import QuantizerRole
from test_cli import ROOT, run_cli

MICRO = ["--model", "micro", "--batch-size", "2", "--no-progress", "--compare"]  # one recipe, no baseline


def _one_line_error(r, *fragments):
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and err[-1].startswith("jaxhq train: error: "), r.stderr[-2000:]
    for f in fragments:
        assert f in err[-1], err[-1]


def test_unwritable_out_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    t0 = time.perf_counter()
    r = run_cli(["train", *MICRO, "--steps", "2", "--out", str(blocker / "out")])
    _one_line_error(r, "--out", "is not a writable directory")
    r = run_cli(["train", *MICRO, "--steps", "2", "--checkpoint-dir", str(blocker / "ck"), "--out", str(tmp_path)])
    _one_line_error(r, "--checkpoint-dir", "is not a writable directory")
    assert time.perf_counter() - t0 < 120  # no training happened (it would compile and run the steps first)


def test_resume_messages_and_checkpoint_of_another_model(tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    r = run_cli(["train", *MICRO, "--steps", "2", "--checkpoint-dir", ck, "--resume", "--out", out])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no checkpoint in" in r.stderr and "starting from step 0" in r.stderr
    r = run_cli(["train", *MICRO, "--steps", "2", "--checkpoint-dir", ck, "--resume", "--seq-len", "16",
                 "--out", out])
    _one_line_error(r, "is of another model", "seq_len: checkpoint 32 vs model 16")


def _wait_for(path, proc, seconds=300):
    t0 = time.perf_counter()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.perf_counter() - t0 < seconds, f"{path} did not appear"
        time.sleep(0.05)


def test_sigterm_saves_and_resume_continues_bit_for_bit(tmp_path):
    steps = "400"
    common = ["train", *MICRO, "--recipe", "fp8_current", "--steps", steps, "--eval-every", "100"]
    ref_out = tmp_path / "ref"
    r = run_cli([*common, "--out", str(ref_out)])
    assert r.returncode == 0, r.stderr[-2000:]

    ck, out = tmp_path / "ck", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "jaxhq", *common, "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "5", "--out", str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(ck / "fp8_current" / "step_00000005" / "meta.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM" in err and "continue with --resume" in err and "Traceback" not in err, err[-2000:]
    saved = sorted(p.name for p in (ck / "fp8_current").iterdir())
    assert saved and saved[-1] != f"step_{int(steps):08d}", saved  # stopped early, with a checkpoint

    r = run_cli([*common, "--checkpoint-dir", str(ck), "--resume", "--out", str(out)])
    assert r.returncode == 0 and "resuming from step" in r.stderr, r.stderr[-2000:]
    a = json.loads((ref_out / "report.json").read_text())["runs"]["fp8_current"]
    b = json.loads((out / "report.json").read_text())["runs"]["fp8_current"]
    assert b["start_step"] > 0
    assert a["train_curve"] == b["train_curve"] and a["val_curve"] == b["val_curve"]
    assert a["final_val_loss"] == b["final_val_loss"]


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    script = textwrap.dedent(f"""
        import json, os, signal
        from jaxhq.train import checkpoint as C, model as M, state as S
        model = M.GPT(M.preset("micro"), S.named_recipe("mxfp8"))
        st = S.create(model, S.make_optimizer())
        C.save({str(tmp_path)!r}, st.replace(step=st.step + 1))
        def die(*a, **k):  # the arrays of step 2 are written, its sidecar is not: the process dies here
            os.kill(os.getpid(), signal.SIGKILL)
        C.json.dump = die
        C.save({str(tmp_path)!r}, st.replace(step=st.step + 2))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    from jaxhq.train import checkpoint as C
    from jaxhq.train import model as M
    from jaxhq.train import state as S
    assert C.latest_step(str(tmp_path)) == 1
    st = S.create(M.GPT(M.preset("micro"), S.named_recipe("mxfp8")), S.make_optimizer())
    restored, meta = C.restore(str(tmp_path), st)
    assert int(restored.step) == 1 and meta["step"] == 1


def test_bad_hybrid_name_says_what_it_must_be():
    for bad in ("hybrid:mxfp8", "hybrid:mxfp8:", "hybrid:a:b:c"):
        with pytest.raises(ValueError, match="hybrid:FORWARD:BACKWARD"):
            recipes.get(bad)


def test_factory_error_names_the_role():
    def factory(role):
        raise KeyError("no rule for this layer")
    role = QuantizerRole("linear", "weight", "layers_3.mlp.fc2")
    with pytest.raises(recipes.FactoryError, match="layers_3.mlp.fc2") as e:
        recipes.CustomRecipe(factory, name="mine").quantizer(role)
    assert isinstance(e.value.__cause__, KeyError) and "no rule for this layer" in str(e.value)


def test_loss_plot_log_axis_has_plain_labels():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from jaxhq.train.run import plain_log_labels
    fig, ax = plt.subplots()
    ax.plot([1, 2], [1.6, 2.9])
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert "2" in labels and all("times" not in t and "^" not in t for t in labels), labels
