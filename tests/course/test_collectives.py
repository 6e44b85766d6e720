"""Chapter 11's experiments: the exercises' solutions, TensorFlow's implementations on the
same tensors, bytes tables, and the all-reduce across real processes (slow)."""

import numpy as np
import pytest

from accel import collectives
from accel.course import allreduce_procs
from accel.course import collectives as course


def test_exercise_solutions():
    assert course.check_exercise(1, None).endswith("not yet (set answer_1)")
    assert course.check_exercise(1, 1835008) == "exercise 1: right (1835008)"  # 2*7/8 MiB
    assert course.check_exercise(2, 78048) == "exercise 2: right (78048)"  # 8 a bw / 10.25
    assert course.check_exercise(3, 8) == "exercise 3: right (8)"
    assert "too low" in course.check_exercise(3, 4)
    with pytest.raises(ValueError, match="number must be 1, 2 or 3"):
        course.check_exercise(4, 1)


def test_tf_implementations_and_bytes_table(four_devices):
    xs = course.placed(four_devices, 9)
    exact = np.sum([np.float64(x.numpy()) for x in xs], axis=0)
    for name in course.TF_IMPLEMENTATIONS:
        for y in course.tf_all_reduce(name, xs, four_devices):
            np.testing.assert_allclose(y.numpy(), exact, rtol=1e-5, atol=1e-6 * abs(exact).max())
    with pytest.raises(ValueError, match="name must be one of"):
        course.tf_all_reduce("nccl", xs, four_devices)
    rows = course.bytes_table(four_devices, 9)
    assert [r[0] for r in rows] == list(collectives.ALGORITHMS)
    assert all(counted == formula for _, counted, formula in rows)
    assert rows[1][1] == [3 * 36, 36, 36, 36]  # through device 0: (n - 1) S, then S


@pytest.mark.slow
def test_process_sweep_sums_correctly_and_ends_its_processes():
    """Both all-reduces across 2 processes check their sums inside (a wrong sum raises)."""
    result = allreduce_procs.sweep(2, [4096, 65536], repeat=1, timeout=200)
    assert result["sizes"] == [4096, 65536] and result["workers"] == 2
    assert len(result["hand"]) == len(result["tf_ring"]) == 2
    lines, ratios = allreduce_procs.process_lines(result)
    assert set(ratios) == {4096, 65536} and len(lines) == 5
