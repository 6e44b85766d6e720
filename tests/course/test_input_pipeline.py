"""accel.course.input_pipeline: the input-bound rule against a hand-written table, and what the
tf.data options do, counted (no timing thresholds)."""

import numpy as np
import pytest

from accel import datasets
from accel.course import input_pipeline as ip


@pytest.mark.parametrize("input_s,compute_s,expected", [
    (0.080, 0.030, "input-bound"),
    (0.030, 0.080, "compute-bound"),
    (0.030, 0.030, "compute-bound"),  # a tie: the devices never wait
    (0.0, 0.001, "compute-bound"),
])
def test_verdict_table(input_s, compute_s, expected):
    assert ip.verdict(input_s, compute_s) == expected


def test_verdict_rejects_negative_times():
    with pytest.raises(ValueError, match="input_s must be"):
        ip.verdict(-1.0, 0.1)


@pytest.mark.parametrize("cache,parallel,prefetch,expected_calls", [
    (False, False, False, 3 * 4), (True, False, True, 4), (False, True, True, 3 * 4),
    (True, True, False, 4)])
def test_map_calls_and_order(cache, parallel, prefetch, expected_calls):
    x, y, _ = datasets.regression(256, 8, seed=0)
    calls = []
    ds = ip.slow_batches(x, y, 64, 0.0, parallel=parallel, prefetch=prefetch, cache=cache,
                         calls=calls)
    for _ in range(3):
        got = [xb.numpy() for xb, _ in ds]
        np.testing.assert_array_equal(np.concatenate(got), x)  # order kept, nothing lost
    assert len(calls) == expected_calls


def test_slow_batches_rejects_bad_arguments():
    x, y, _ = datasets.regression(64, 8, seed=0)
    with pytest.raises(ValueError, match="delay_s must be"):
        ip.slow_batches(x, y, 16, -0.1)
    with pytest.raises(ValueError, match="parallel_calls must be"):
        ip.slow_batches(x, y, 16, 0.0, parallel=True, parallel_calls=0)


def test_measure_input_reports_every_variant(four_devices):
    res = ip.measure_input(four_devices[0], batch_size=16, steps=2, delay_s=0.0,
                           sizes=(8, 8, 1))
    assert set(res["seconds"]) == {"compute", "input", *ip.VARIANTS}
    assert res["verdict"] in ("input-bound", "compute-bound")
