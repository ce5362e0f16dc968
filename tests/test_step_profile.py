"""benchmarks/step_profile.py: the busy time and span per step of a profile of steps run back to back."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import pytest  # noqa: E402
from step_profile import covered_ns, per_step  # noqa: E402


def test_covered_counts_overlaps_once():
    assert covered_ns([(0, 10), (5, 12), (20, 25)]) == 17
    assert covered_ns([(3, 4), (0, 10)]) == 10


def test_per_step_leaves_out_the_gaps_between_steps():
    # three steps of two kernels each (2 ns idle inside a step), 1000 ns of host gap before the third step
    steps = [(0, 4), (6, 10), (10, 14), (16, 20), (1020, 1024), (1026, 1030)]
    busy, span = per_step(steps[::-1], 3)  # any order
    assert (busy, span) == (pytest.approx(8e-6), pytest.approx(10e-6))


def test_per_step_with_an_uneven_count_takes_the_whole_profile():
    busy, span = per_step([(0, 4), (6, 10), (10, 14), (16, 20), (30, 31)], 2)
    assert (busy, span) == (pytest.approx(8.5e-6), pytest.approx(15.5e-6))


def test_profile_of_a_jitted_step_splits_its_time_on_the_cpu():
    """The whole path on the CPU backend (its thunks stand in for device events): a GEMM step's profile has its
    dot in the gemm category, every op matched to the compiled HLO."""
    import jax
    import jax.numpy as jnp
    from step_profile import profile_step

    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    a = jnp.ones((256, 256), jnp.float32)
    f(a, a).block_until_ready()
    prof = profile_step(lambda: f(a, a).block_until_ready(), 2, f.lower(a, a).compile().as_text(), 1e-3)
    assert "profile_error" not in prof, prof.get("profile_error")
    assert prof["gemm_ms"] > 0 and prof["kernels_per_step"]["gemm"] >= 1
    assert prof["unmatched_ops"] == 0
