"""What the distributed tests share: one running 1 ps + 2 workers cluster (each task its own
process; starting one takes several seconds of imports, so the modules that only need *a*
cluster share one per pytest process), and the
problem every replication test trains: one regression task, its global batches, and the
weights plain single-device SGD reaches on them (the reference the synchronous runs must
equal)."""

import pytest

from accel import datasets, models
from accel.distributed import cluster as C
from accel.distributed import replication as R


@pytest.fixture(scope="session")
def cluster():
    """A 1 ps + 2 workers LocalCluster for every module that needs one; ended after the last."""
    with C.LocalCluster(ps=1, workers=2, timeout=90) as c:
        yield c

LR, STEPS = 0.05, 6


@pytest.fixture(scope="module")
def problem():
    x, y, _ = datasets.regression(256, 8, 1, seed=0)
    init = models.mlp_init([8, 16, 1], seed=0)
    batches = R.global_batches(x, y, 32, STEPS)
    return init, batches, R.reference_sgd(models.mlp_apply, init, batches, LR)
