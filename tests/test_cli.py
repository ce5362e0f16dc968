"""`jaxhq train | plan | bench` through `python -m jaxhq`: bad options end in one line, not a traceback."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxhq import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "jaxhq", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def one_line_error(capsys, argv, *fragments):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"jaxhq {argv[0]}: error: ")
    for f in fragments:
        assert f in err, err
    return err


def test_unknown_recipe(capsys):
    one_line_error(capsys, ["train", "--recipe", "fp9"], "unknown recipe 'fp9'", "mxfp8", "module:function")
    one_line_error(capsys, ["train", "--compare", "bf17"], "unknown recipe 'bf17'")
    one_line_error(capsys, ["train", "--recipe", "hybrid:mxfp8:fp9"], "hybrid:mxfp8:fp9")


def test_bad_factory_paths(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_factories.py").write_text(textwrap.dedent("""
        import jaxhq
        def not_a_factory():
            return 42
        def per_role(role):
            return jaxhq.MXFP8("e4m3")
        def make():
            return per_role
        def returns_none(role):
            return None
        CONST = 3
    """))
    one_line_error(capsys, ["train", "--recipe", "no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'")
    one_line_error(capsys, ["train", "--recipe", "my_factories:missing"], "has no function 'missing'")
    one_line_error(capsys, ["train", "--recipe", "my_factories:CONST"], "has no function 'CONST'")
    one_line_error(capsys, ["train", "--recipe", "my_factories:not_a_factory"], "returned int")
    one_line_error(capsys, ["train", "--recipe", "my_factories:a:b"], "bad factory path")
    one_line_error(capsys, ["train", "--recipe", "my_factories:returns_none", "--model", "micro"],
                   "return Identity()")
    assert cli.load_recipe("my_factories:per_role").name == "my_factories:per_role"
    assert cli.load_recipe("my_factories:make").quantizer(cli._recipes.QuantizerRole("linear", "input", "x")) \
        .name == "mxfp8"


def test_mesh_must_match_device_count(capsys):
    import jax
    n = jax.device_count()
    one_line_error(capsys, ["train", "--mesh", f"fsdp={n + 1}"], f"has {n + 1} devices", f"has {n}")
    one_line_error(capsys, ["train", "--mesh", "pipeline=2"], "bad mesh", "data, fsdp, tensor, expert")
    one_line_error(capsys, ["train", "--mesh", "fsdp=2,fsdp=1"], "given twice")
    assert cli.parse_mesh(f"data={n}", n) == {"data": n}


def test_model_that_does_not_fit_the_format_blocks(capsys):
    # NVFP4's Hadamard transform runs along the token axis of the wgrad copies: 24 tokens is not a multiple of 16
    one_line_error(capsys, ["train", "--recipe", "nvfp4", "--model", "micro", "--batch-size", "1", "--seq-len", "24"],
                   "does not fit recipe 'nvfp4'", "multiple of 16")
    one_line_error(capsys, ["train", "--model", "huge"], "unknown model 'huge'", "tiny")


def test_train_end_to_end_through_python_m(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["train", "--model", "micro", "--steps", "4", "--batch-size", "2", "--eval-every", "2",
                 "--recipe", "fp8_current", "--compare", "bf16", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fp8_current" in r.stdout and "val vs bf16" in r.stdout and "loss.png" in r.stdout
    assert "step 4/4" in r.stderr  # the progress bar
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["runs"]) == {"fp8_current", "bf16"} and rep["config"]["steps"] == 4
    assert (out / "loss.png").stat().st_size > 10_000


def test_plan_prints_the_role_table(capsys):
    assert cli.main(["plan", "--recipe", "hybrid:mxfp8:nvfp4", "--model", "micro"]) == 0
    out = capsys.readouterr().out
    assert "recipe: hybrid:mxfp8:nvfp4" in out
    for name in ("layers_0.attn.qkv", "layers_0.mlp.fc1", "lm_head"):
        assert name in out
    lm = [l for l in out.splitlines() if l.startswith("lm_head") and " weight " in l][0]
    assert "mxfp8" in lm and "nvfp4" in lm  # forward copy MXFP8, backward copy NVFP4


def test_bench_with_no_match_is_a_clear_error(capsys):
    one_line_error(capsys, ["bench", "no_such_benchmark_xyz"], "no benchmarks found")


def test_bench_lists_runnable_benchmarks(capsys):
    assert cli.main(["bench", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all(n.endswith(".py") for n in names) and "common.py" not in names
