"""accel.distributed.tf2_runs: MultiWorkerMirroredStrategy in two processes equals one device
on the global batch; ParameterServerStrategy runs a function cut off by a killed worker again
(at-least-once)."""

import numpy as np
import pytest

from accel import models
from accel.distributed import cluster as C
from accel.distributed import tf2_runs as T

LR, STEPS = 0.05, 6


@pytest.mark.slow
def test_multi_worker_mirrored_equals_one_device_and_both_workers_agree(problem):
    init, batches, ref = problem
    first, second = T.mirrored_run(models.mlp_apply, init, batches, LR)
    assert models.max_difference(first, second) == 0.0
    for a, r in zip(first, ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6 * np.max(np.abs(r)))


@pytest.mark.slow
def test_a_worker_killed_mid_step_has_its_function_run_again(problem):
    init, batches, _ = problem
    with C.LocalCluster(chief=True, skip=[("chief", 0)], timeout=90) as cluster:
        result = T.coordinated_run(cluster, models.mlp_apply, init, batches, LR,
                                   kill_mid_step=True)
        assert not cluster.children[("worker", 1)].alive()
    assert result["killed"] == [("worker", 1)]
    # killed while each worker held a function whose update was on the ps and none had ended
    assert result["at_kill"] == {"scheduled": STEPS, "applied": 2, "finished": 0}
    # the cut-off function ran again on worker 0: its update landed twice (at-least-once)
    assert (result["scheduled"], result["finished"], result["applied"]) == (
        STEPS, STEPS, STEPS + 1)
    assert models.max_difference(result["params"], init) > 1e-3


def test_the_coordinator_needs_a_chief_slot_left_free():
    c = C.LocalCluster(ps=1, workers=1)
    with pytest.raises(ValueError, match="needs a chief task"):
        T.coordinated_run(c, models.mlp_apply, [], [], 0.1)
