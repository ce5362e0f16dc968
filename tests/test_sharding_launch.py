"""Runs the 8-device test files (EIGHT_DEVICE_FILES) in a subprocess with 8 CPU devices when this process has
fewer, so that they run in the ordinary suite without changing the device count the other test files see.

The subprocess runs the tests not marked slow (JAXHQ_SHARDING_ALL=1: all of them) with JAXHQ_KERNELS=all (the
FFI quantize and GEMM custom calls on their CPU handlers: the program structure a GPU compiles, partitioning
included), and compiles with XLA's backend optimisation level 0 (half the compile time; the sharded and
unsharded steps it compares are built with the same flags).
"""
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

# file: extra pytest arguments (test_moe_dispatch.py's one-device tests run in the ordinary suite)
EIGHT_DEVICE_FILES = {"test_sharding.py": [], "test_sequence_parallel.py": [], "test_gemm_sharding.py": [],
                      "test_fsdp_reshard.py": [], "test_moe_dispatch.py": ["-k", "sharded"]}


@pytest.mark.parametrize("test_file", list(EIGHT_DEVICE_FILES))
def test_sharding_suite_on_8_cpu_devices(test_file):
    import jax
    if jax.device_count() >= 8:
        pytest.skip(f"this process already has 8 devices: {test_file} runs directly")
    here = HERE
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                 "--xla_backend_optimization_level=0"]).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAXHQ_KERNELS"] = "all"
    import jaxhq  # the subprocess imports this same jaxhq (an installed package need not be the checkout)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(jaxhq.__file__)),
                                                    env.get("PYTHONPATH")) if p)
    select = [] if env.get("JAXHQ_SHARDING_ALL") == "1" else ["-m", "not slow"]
    cmd = [sys.executable, "-m", "pytest", str(here / test_file), *EIGHT_DEVICE_FILES[test_file], "-q", "-x",
           "-p", "no:cacheprovider", *select]
    r = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=1200)
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, f"8-device sharding tests failed ({' '.join(cmd)}):\n{tail}"
    assert " passed" in tail, tail

