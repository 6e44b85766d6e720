"""accel.parallel.local_sgd against plain NumPy loops written out here: every=1 is SGD on the
whole batch, every=k is k independent SGD runs averaged; bytes against the ring's formula."""

import numpy as np
import pytest

from accel import datasets
from accel.parallel.local_sgd import local_sgd
from accel.training import squared_error

LR = 0.05


def linear(params, x):
    return x @ params[0] + params[1]


def grads_by_hand(w, b, x, y):
    """Gradient of mean((x w + b - y)^2) over examples and outputs."""
    r = x @ w + b - y
    return 2 * x.T @ r / r.size, 2 * r.sum(axis=0) / r.size


@pytest.fixture(scope="module")
def problem():
    x, y, _ = datasets.regression(4 * 8 * 4, 8, 4, seed=3)
    x, y = x.astype(np.float64), y.astype(np.float64)
    shards = [[(x[(4 * t + i) * 8:(4 * t + i + 1) * 8], y[(4 * t + i) * 8:(4 * t + i + 1) * 8])
               for t in range(4)] for i in range(4)]
    params = [np.full((8, 4), 0.1), np.zeros(4)]
    return x, y, shards, params


@pytest.mark.parametrize("every", [1, 2, 4])
def test_local_sgd_equals_averaged_numpy_runs(problem, four_devices, every):
    x, y, shards, params = problem
    got = local_sgd(linear, squared_error, params, shards, four_devices, every=every, steps=8,
                    learning_rate=LR, x_eval=x, y_eval=y)
    w, b = [params[0].copy()] * 4, [params[1].copy()] * 4
    for t in range(8):
        for i in range(4):
            gw, gb = grads_by_hand(w[i], b[i], *shards[i][t % 4])
            w[i], b[i] = w[i] - LR * gw, b[i] - LR * gb
        if (t + 1) % every == 0:
            w, b = [np.mean(w, axis=0)] * 4, [np.mean(b, axis=0)] * 4
    np.testing.assert_allclose(got.params[0], w[0], rtol=1e-12)
    np.testing.assert_allclose(got.params[1], b[0], rtol=1e-12)
    assert got.syncs == 8 // every and len(got.losses) == got.syncs
    # ring of 4: each device sends 2 * 3 / 4 of each tensor per sync (256 + 32 bytes, float64)
    assert got.bytes_per_device == got.syncs * 2 * 3 * (256 + 32) // 4


def test_every_one_is_sgd_on_the_whole_batch(problem, four_devices):
    x, y, shards, params = problem
    got = local_sgd(linear, squared_error, params, shards, four_devices, every=1, steps=4,
                    learning_rate=LR)
    w, b = params[0].copy(), params[1].copy()
    for t in range(4):
        xb = np.concatenate([shards[i][t][0] for i in range(4)])
        yb = np.concatenate([shards[i][t][1] for i in range(4)])
        gw, gb = grads_by_hand(w, b, xb, yb)
        w, b = w - LR * gw, b - LR * gb
    np.testing.assert_allclose(got.params[0], w, rtol=1e-12)


def test_bad_input_names_the_value(problem, four_devices):
    _, _, shards, params = problem
    with pytest.raises(ValueError, match="steps=6 is not a multiple of every=4"):
        local_sgd(linear, squared_error, params, shards, four_devices, every=4, steps=6,
                  learning_rate=LR)
    with pytest.raises(ValueError, match="got 3 shards for 4 devices"):
        local_sgd(linear, squared_error, params, shards[:3], four_devices, every=1, steps=1,
                  learning_rate=LR)
    with pytest.raises(ValueError, match="every"):
        local_sgd(linear, squared_error, params, shards, four_devices, every=0, steps=1,
                  learning_rate=LR)
