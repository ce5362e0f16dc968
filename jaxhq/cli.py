"""`jaxhq train | plan | bench`: the command line. Bad options end in one line on stderr, not a traceback.

`--recipe` takes a named recipe ("mxfp8", "hybrid:mxfp8:nvfp4", ...) or `module:function`, where the function
is either a factory `(role) -> Quantizer` or takes no arguments and returns a factory or a CustomRecipe.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
from typing import Optional

from . import recipes as _recipes


class UsageError(ValueError):
    """A bad command-line option; printed as one line."""


def _is_factory(fn) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def load_recipe(spec: str) -> _recipes.CustomRecipe:
    """A recipe from a name or from `module:function` (a factory, or a function returning a factory/recipe)."""
    if spec in _recipes.NAMED or spec.startswith("hybrid:"):
        try:
            return _recipes.get(spec)
        except (ValueError, KeyError) as e:
            raise UsageError(f"bad recipe {spec!r}: {e}; use hybrid:FORWARD:BACKWARD with named recipes") from None
    if ":" not in spec:
        raise UsageError(f"unknown recipe {spec!r}; named recipes: {', '.join(_recipes.NAMED)}, "
                         "hybrid:FORWARD:BACKWARD, or module:function for your own factory")
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name or ":" in fn_name:
        raise UsageError(f"bad factory path {spec!r}; expected module:function, e.g. my_recipes:first_last")
    sys.path.insert(0, os.getcwd()) if os.getcwd() not in sys.path else None
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"bad factory path {spec!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise UsageError(f"bad factory path {spec!r}: module {mod_name!r} has no function {fn_name!r}")
    if _is_factory(fn):
        return _recipes.CustomRecipe(fn, name=spec)
    try:
        out = fn()
    except Exception as e:
        raise UsageError(f"factory path {spec!r}: {fn_name}() raised {type(e).__name__}: {e}") from None
    if isinstance(out, _recipes.CustomRecipe):
        return out
    if callable(out):
        return _recipes.CustomRecipe(out, name=spec)
    raise UsageError(f"factory path {spec!r}: {fn_name}() returned {type(out).__name__}, expected a factory "
                     "(role) -> Quantizer or a CustomRecipe")


def parse_mesh(spec: Optional[str], device_count: int) -> Optional[dict]:
    """"fsdp=4,tensor=2" -> {"fsdp": 4, "tensor": 2}; the sizes must multiply to the device count."""
    if not spec:
        return None
    axes = ("data", "fsdp", "tensor", "expert")
    sizes = {}
    for part in spec.split(","):
        name, eq, val = part.strip().partition("=")
        if not eq or name not in axes or not val.isdigit() or int(val) < 1:
            raise UsageError(f"bad mesh {spec!r}: expected AXIS=SIZE[,AXIS=SIZE] with axes {', '.join(axes)}")
        if name in sizes:
            raise UsageError(f"bad mesh {spec!r}: axis {name!r} given twice")
        sizes[name] = int(val)
    if math.prod(sizes.values()) != device_count:
        raise UsageError(f"mesh {spec!r} has {math.prod(sizes.values())} devices but this machine has "
                         f"{device_count}; sizes must multiply to the device count")
    return sizes


def check_writable(path: str, flag: str) -> None:
    """Create `path` (a directory) and prove a file can be written there, before any training step."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".jaxhq_write_check")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path!r} is not a writable directory: {e.strerror or e}") from None


def check_fits(recipe, model_config, batch_size: int) -> None:
    """Trace one train step (no compute) so a model that the recipe's formats cannot take fails here."""
    import jax
    from .train import model as _model, state as _state
    model = _model.GPT(model_config, recipe)
    batch = {"inputs": jax.ShapeDtypeStruct((batch_size, model_config.seq_len), "int32"),
             "targets": jax.ShapeDtypeStruct((batch_size, model_config.seq_len), "int32")}
    try:
        st = jax.eval_shape(lambda: _state.create(model, _state.make_optimizer()))
        jax.eval_shape(_state._train_step, st, batch)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {model_config.num_layers}x{model_config.d_model} (seq_len {model_config.seq_len},"
                         f" batch {batch_size}) does not fit recipe {recipe.name!r}: {msg}") from None


def _train(args) -> int:
    import jax
    from .train import model as _model
    from .train.run import RunConfig, run
    try:
        model_config = _model.preset(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    recipes = [load_recipe(args.recipe)] + [load_recipe(c) for c in args.compare]
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    mesh_sizes = parse_mesh(args.mesh, jax.device_count())
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    check_writable(args.out, "--out")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir, "--checkpoint-dir")
    model_config = model_config.replace(remat=args.remat, **({"seq_len": args.seq_len} if args.seq_len else {}))
    mesh = None
    if mesh_sizes and math.prod(mesh_sizes.values()) > 1:
        from .sharding import make_mesh
        mesh = make_mesh(**mesh_sizes)
    from .train.sharded import mesh_context
    with mesh_context(mesh):
        for r in recipes:
            check_fits(r, model_config, args.batch_size)
    cfg = RunConfig(recipe=recipes[0].name, compare=tuple(r.name for r in recipes[1:]), steps=args.steps,
                    model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                    seed=args.seed, eval_every=args.eval_every, out=args.out,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
                    mesh=args.mesh, remat=args.remat, progress=not args.no_progress)
    print(f"jaxhq train: model {args.model} ({model_config.num_params() / 1e6:.2f}M params), "
          f"recipes {', '.join(r.name for r in recipes)}, {args.steps} steps on {jax.devices()[0].platform}",
          file=sys.stderr)
    from .train.checkpoint import CheckpointError
    from .train.run import Stopped
    try:
        run(cfg, recipes=recipes, mesh=mesh)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    except Stopped as e:
        print(f"jaxhq train: {e}", file=sys.stderr)
        return 128 + e.signum
    return 0


def _plan(args) -> int:
    from .plan import plan
    from .train import model as _model
    try:
        model_config = _model.preset(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    recipe = load_recipe(args.recipe)
    check_fits(recipe, model_config, 1)
    model = _model.GPT(model_config, recipe)
    print(plan(recipe, model, _model.example_tokens(model_config, 1)))
    return 0


def benchmark_scripts(only=()) -> list:
    """The runnable scripts in benchmarks/ (those with a __main__ block), filtered by name fragments: those of
    the checkout in the working directory, else of the source tree this package runs from."""
    import glob
    here = os.path.join(os.getcwd(), "benchmarks")
    root = here if os.path.isdir(here) else os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    out = []
    for s in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(s) as f:
            if "__main__" not in f.read():
                continue
        if not only or any(o in os.path.basename(s) for o in only):
            out.append(s)
    if not out:
        raise UsageError(f"no benchmarks found in {root}" + (f" matching {' '.join(only)}" if only else ""))
    return out


def _bench(args) -> int:
    """Each benchmark runs in its own process (some set XLA flags before importing jax); output streams."""
    import subprocess
    scripts = benchmark_scripts(args.only)
    if args.list:
        print("\n".join(os.path.basename(s) for s in scripts))
        return 0
    root = os.path.dirname(os.path.dirname(scripts[0]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    failed = []
    for s in scripts:
        print(f"== {os.path.basename(s)}", flush=True)
        r = subprocess.run([sys.executable, s, *args.args], cwd=root, env=env)
        if r.returncode:
            failed.append(f"{os.path.basename(s)} (exit {r.returncode})")
    if failed:
        print(f"jaxhq bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxhq", description="Low-precision training for JAX with per-role quantizers.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a GPT on the embedded corpus and compare recipes",
                       description="Train a byte-level GPT on text that ships with Python (pydoc topics and the "
                                   "standard library's sources) under a recipe, next to a bf16 baseline.")
    t.add_argument("--recipe", default="mxfp8", help="named recipe (bf16, fp8_current, fp8_delayed, mxfp8, nvfp4, "
                   "fp8_block, hybrid:FWD:BWD) or module:function of your factory (default mxfp8)")
    t.add_argument("--compare", nargs="*", default=["bf16"], metavar="RECIPE",
                   help="recipes also trained with the same seed and data order (default bf16; "
                        "`--compare` with no value trains only --recipe)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--model", default="tiny", help="preset: micro, tiny (CPU), small, medium (GPU)")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--mesh", default=None, help="device mesh, e.g. fsdp=4,tensor=2 (sizes multiply to the "
                                                "device count)")
    t.add_argument("--remat", default="none", choices=("none", "full", "quantized", "offload"),
                   help="activation recompute per layer; 'quantized' saves only the quantized residuals, "
                        "'offload' keeps them in host memory")
    t.add_argument("--checkpoint-dir", default=None)
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    t.add_argument("--out", default="jaxhq_out", help="directory for report.json and loss.png")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)
    pl = sub.add_parser("plan", help="print the role/format table of a model under a recipe")
    pl.add_argument("--recipe", default="mxfp8")
    pl.add_argument("--model", default="tiny")
    pl.set_defaults(func=_plan)
    b = sub.add_parser("bench", help="run the benchmarks in benchmarks/ and print their tables")
    b.add_argument("only", nargs="*", help="run only benchmarks whose file name contains one of these")
    b.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    b.add_argument("--args", nargs=argparse.REMAINDER, default=[], help="arguments passed to every benchmark")
    b.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"jaxhq {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxhq {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
