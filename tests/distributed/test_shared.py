"""accel.distributed.shared: placement by bytes (against hand counts), state shared between
this process and another on a real ps, and the two ensembles against the plain average."""

import numpy as np
import pytest
import tensorflow as tf

from accel import models
from accel.distributed import shared

SHAPES = [(1000, 64), (64,), (64, 64), (64,), (64, 1), (1,)]


def placed(strategy=None):
    with tf.Graph().as_default() as graph:
        with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                ps_tasks=2, ps_strategy=strategy)):
            for i, shape in enumerate(SHAPES):
                tf.Variable(tf.zeros(shape), name=f"v{i}")
    return shared.bytes_per_task(graph)


def test_round_robin_and_byte_balancing_against_hand_counts():
    # round-robin: v0, v2, v4 on task 0; v1, v3, v5 on task 1 (float32 = 4 bytes)
    assert placed() == {"/job:ps/task:0": 4 * (64000 + 4096 + 64),
                        "/job:ps/task:1": 4 * (64 + 64 + 1)}
    # greedy by bytes: v0 -> 0; then every later variable goes to the lighter task 1
    assert placed(shared.ByteSizeStrategy(2)) == {"/job:ps/task:0": 4 * 64000,
                                                  "/job:ps/task:1": 4 * (64 + 4096 + 64 + 64 + 1)}


def test_byte_size_strategy_greedy_order_by_hand():
    class Op:
        def __init__(self, shape, dtype=tf.float32):
            self.attrs = {"shape": tf.TensorShape(shape).as_proto(), "dtype": dtype}

        def get_attr(self, name):
            return self.attrs[name]
    s = shared.ByteSizeStrategy(3)
    assert [s(Op(shape)) for shape in [(10,), (4,), (4,), (2,), (8,)]] == [0, 1, 2, 1, 2]
    assert s.loads == [40, 24, 48]
    assert shared.variable_bytes(Op((3, 5), tf.float64)) == 120
    with pytest.raises(ValueError, match="num_tasks"):
        shared.ByteSizeStrategy(0)


@pytest.mark.slow
def test_a_variable_and_a_queue_are_shared_with_another_process(cluster):
    target = cluster.target("ps", 0)
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps"], operation_timeout_in_ms=30000)
    with tf.Graph().as_default(), tf.compat.v1.container("t-share"):
        counter, box = shared.mailbox()
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(counter.initializer)
            sess.run(counter.assign_add(5))
        assert shared.visit(cluster.cluster, "t-share", add=2, put=[4, 5]) == 7
        with tf.compat.v1.Session(target, config=config) as sess:
            assert sess.run(counter.read_value()) == 7
            assert sess.run(box.dequeue_many(2)).tolist() == [4, 5]
    tf.compat.v1.Session.reset(target, ["t-share"])


@pytest.mark.slow
def test_both_ensembles_average_the_networks(cluster):
    nets = [models.mlp_init([8, 16, 1], seed=s) for s in (1, 2)]
    rows = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    ref = np.mean([models.mlp_apply(n, rows).numpy() for n in nets], axis=0)
    np.testing.assert_allclose(
        shared.in_graph_ensemble(cluster.cluster, models.mlp_apply, nets, rows), ref,
        rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    avg, error = shared.between_graph_ensemble(cluster.cluster, models.mlp_apply, nets, rows,
                                               wait_ms=500)
    np.testing.assert_allclose(avg, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    assert error == "DeadlineExceededError"
