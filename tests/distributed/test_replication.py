"""accel.distributed.replication: the four combinations on a real 1 ps + 2 workers cluster;
the synchronous ones equal one device's SGD on the global batch, the asynchronous ones apply
every gradient exactly once, each at a recorded version; in every one, one global batch sends
each worker the model's bytes of weights and the ps each worker's gradient (counted from the
executed partition graphs, against the parameters' own sizes)."""

import numpy as np
import pytest

from accel import models
from accel.distributed import replication as R

LR, STEPS = 0.05, 6


def close(actual, ref, scales=None):
    """rtol 1e-5, atol 1e-6 of the largest reference value, or of ``scales[i]`` where the
    reference is a difference of larger float32 terms (a bias that ends near 0: its rounding
    is that of the terms, not of the result)."""
    scales = scales or [np.max(np.abs(r)) for r in ref]
    for a, r, scale in zip(actual, ref, scales, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6 * scale)


def test_global_batches_wrap_around_and_reference_is_plain_sgd():
    x = np.arange(10, dtype=np.float32)[:, None]
    got = R.global_batches(x, x, 4, 3)
    assert [b[0][:, 0].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    # one linear layer, loss mean((x w + b - y)^2): gradient by hand
    init = [np.array([[0.5]], np.float32), np.array([0.0], np.float32)]
    xb, yb = np.array([[1.0], [2.0]], np.float32), np.array([[1.0], [3.0]], np.float32)
    r = [(0.5 * 1 - 1), (0.5 * 2 - 3)]
    gw, gb = np.mean([2 * r[0] * 1, 2 * r[1] * 2]), np.mean([2 * r[0], 2 * r[1]])
    close(R.reference_sgd(models.mlp_apply, init, [(xb, yb)], 0.1),
          [[[0.5 - 0.1 * gw]], [-0.1 * gb]])


@pytest.mark.slow
@pytest.mark.parametrize("run", [R.in_graph, R.between_graph], ids=["in-graph", "between-graph"])
def test_sync_equals_one_device_on_the_global_batch(cluster, problem, run):
    init, batches, ref = problem
    result = run(cluster.cluster, "sync", models.mlp_apply, init, batches, LR)
    assert result.updates == STEPS and result.records == []
    close(result.params, ref)
    assert models.max_difference(result.params, init) > 1e-3  # it did train
    check_traffic(result, init)


def check_traffic(result, init, workers=2):
    """One global batch: every worker reads each parameter from the ps once and sends the ps
    one gradient of each; the two halves of the batch are data."""
    totals = R.link_totals(result.traffic)
    model = sum(p.nbytes for p in init)
    assert totals["weights"] == (workers * len(init), workers * model)
    assert totals["gradients"] == (workers * len(init), workers * model)
    x, y = 16 * 8 * 4, 16 * 1 * 4  # a half batch of float32 features and targets
    # in-graph, worker 0's half is fed where the client runs: only worker 1's crosses
    want = (2, x + y) if result.kind.startswith("in-graph") else (4, 2 * (x + y))
    assert totals["data"] == want
    assert {s.source for s in result.traffic if s.kind == "weights"} == {"ps:0"}
    assert {s.target for s in result.traffic if s.kind == "gradients"} == {"ps:0"}


@pytest.mark.slow
@pytest.mark.parametrize("run", [R.in_graph, R.between_graph], ids=["in-graph", "between-graph"])
def test_async_applies_every_gradient_once_at_a_recorded_version(cluster, problem, run):
    init, batches, ref = problem
    result = run(cluster.cluster, "async", models.mlp_apply, init, batches, LR)
    assert result.updates == 2 * STEPS
    assert [r.applied_version for r in result.records] == list(range(2 * STEPS))
    # in-graph: each thread feeds its own half of every global batch (step = batch index);
    # between-graph: the workers take the half-batches from the shared queue (step = item)
    assert [sum(r.worker == w for r in result.records) for w in (0, 1)] == [STEPS, STEPS]
    assert sorted(r.step for r in result.records) == (
        sorted(list(range(STEPS)) * 2) if run is R.in_graph else list(range(2 * STEPS)))
    assert all(0 <= r.staleness <= r.applied_version for r in result.records)
    assert all(r.examples == 16 for r in result.records)
    assert models.max_difference(result.params, init) > 1e-3
    # no update lost: plain SGD ends at the start minus lr times every gradient applied. The
    # updates are applied in float32 in another order than the float64 sum, and the one-element
    # output bias (0 at the start) ends as a small sum of larger updates of both signs: its
    # rounding is judged against the model's weights (atol 1e-6 of the largest), not itself
    want = [p - LR * g for p, g in zip(init, result.gradient_sum, strict=True)]
    close(result.params, want, [max(np.max(np.abs(w)) for w in want)] * len(want))
    assert 0 < result.seconds
    check_traffic(result, init)
    # one size per update; the largest is at least the mean step (triangle inequality)
    assert len(result.update_sizes) == result.updates
    total = max(np.max(np.abs(LR * g)) for g in result.gradient_sum)
    assert max(result.update_sizes) >= total / result.updates * (1 - 1e-6)
    # the check above has teeth: a lost or overwritten update would leave some weight off by
    # its size, and the smallest update is over 100 x the chapter's tolerance (rtol 1e-5,
    # atol 1e-6 of allclose)
    scale = max(np.max(np.abs(w)) for w in want)
    assert min(result.update_sizes) > 100 * (1e-6 + 1e-5 * scale)


@pytest.mark.slow
def test_every_run_lives_in_its_own_container_which_is_emptied(cluster, problem):
    init, batches, _ = problem
    R.in_graph(cluster.cluster, "sync", models.mlp_apply, init, batches[:1], LR,
               container="c-test")
    # after the reset the variables are gone: reading them is an error
    import tensorflow as tf
    with pytest.raises(tf.errors.FailedPreconditionError):
        R.read_params(cluster.target("ps", 0), "c-test", init)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        R.in_graph({"worker": ["a:1"]}, "hogwild", models.mlp_apply, [], [], 0.1)
    with pytest.raises(ValueError, match="a global batch of 5 does not split over 2"):
        R.between_graph({"ps": ["a:1"], "worker": ["a:2", "a:3"]}, "sync", models.mlp_apply,
                        [np.zeros(1)], [(np.zeros((5, 1)), np.zeros((5, 1)))], 0.1)
    with pytest.raises(ValueError, match="model_fn must be a function"):
        R.in_graph({"worker": ["a:1"]}, "sync", None, [], [], 0.1)
    # the client processes import the model by name: a lambda cannot travel
    with pytest.raises(ValueError, match="model_fn must be a function defined at the top"):
        R.between_graph({"ps": ["a:1"], "worker": ["a:2"]}, "sync", lambda p, x: x,
                        [np.zeros(1)], [(np.zeros((2, 1)), np.zeros((2, 1)))], 0.1)


def test_link_totals_counts_tensors_and_bytes_by_kind():
    sent = [R.Sent("ps:0", "worker:0", 512, "MatMul/ReadVariableOp:0", "weights"),
            R.Sent("ps:0", "worker:1", 512, "MatMul_2/ReadVariableOp:0", "weights"),
            R.Sent("worker:0", "ps:0", 512, "gradients/MatMul_grad/MatMul_1:0", "gradients"),
            R.Sent("worker:0", "ps:0", 0, "Identity/ctrl_S4:0", "control"),
            R.Sent("ps:0", "worker:0", 8, "sync_token_q_Dequeue:0")]
    assert R.link_totals(sent) == {"weights": (2, 1024), "gradients": (1, 512),
                                   "data": (0, 0), "other": (1, 8)}
    with pytest.raises(ValueError, match="unknown kind"):
        R.link_totals([R.Sent("ps:0", "worker:0", 1, "t:0", "bias")])
    with pytest.raises(ValueError, match="Sent records"):
        R.link_totals([("ps:0", "worker:0", 1, "t:0")])


def test_task_names_come_from_device_names():
    assert R._task("/job:ps/replica:0/task:1/device:CPU:0") == "ps:1"
    assert R._task("/job:worker/replica:0/task:0/device:CPU:0") == "worker:0"


def test_versions_are_distinct_under_concurrent_updates():
    # four threads advance one counter at once, as the asynchronous replicas do: every value
    # before an increment is handed out exactly once (an assign_add and a later read could
    # both see another thread's increment)
    import threading

    import tensorflow as tf

    with tf.Graph().as_default():
        version = tf.Variable(0, dtype=tf.int64)
        nxt = R._next_version(version)
        with tf.compat.v1.Session() as sess:
            sess.run(version.initializer)
            seen, lock = [], threading.Lock()

            def advance():
                got = [int(sess.run(nxt)) for _ in range(200)]
                with lock:
                    seen.extend(got)

            threads = [threading.Thread(target=advance) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(seen) == list(range(800))
            assert sess.run(version) == 800
