"""The problem every replication test trains: one regression task, its global batches, and the
weights plain single-device SGD reaches on them (the reference the synchronous runs must equal)."""

import pytest

from accel import data, models
from accel.distributed import replication as R

LR, STEPS = 0.05, 6


@pytest.fixture(scope="module")
def problem():
    x, y, _ = data.regression(256, 8, 1, seed=0)
    init = models.mlp_init([8, 16, 1], seed=0)
    batches = R.global_batches(x, y, 32, STEPS)
    return init, batches, R.reference_sgd(init, batches, LR)
