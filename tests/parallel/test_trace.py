"""accel.parallel.trace: busy intervals and idle fractions from hand-written step stats (the
clock is injected: a StepStats proto written out here), transfers on a tiny two-device graph."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import step_stats_pb2
from tensorflow.core.protobuf import config_pb2

from accel.parallel import trace

LOCAL = "/job:localhost/replica:0/task:0"


def stats(table):
    """{device: [(name, start_us, duration_us), ...]} as a StepStats proto."""
    s = step_stats_pb2.StepStats()
    for dev, nodes in table.items():
        d = s.dev_stats.add(device=LOCAL + dev)
        for name, start, dur in nodes:
            d.node_stats.add(node_name=name, all_start_micros=start, all_end_rel_micros=dur)
    return s


def test_busy_intervals_merge_and_idle_by_hand():
    s = stats({"/device:CPU:0": [("a", 1000, 10), ("b", 1005, 10), ("_Send", 1020, 50),
                                 ("c", 1080, 20)],
               "/device:CPU:1": [("d", 1015, 65)]})
    iv = trace.busy_intervals(config_pb2.RunMetadata(step_stats=s), ["/cpu:0", "/cpu:1"])
    # a and b overlap -> one interval 0..15 us; _Send is bookkeeping; c 80..100 us
    assert iv.keys() == {"/cpu:0", "/cpu:1"}
    np.testing.assert_allclose(iv["/cpu:0"], [(0.0, 15e-6), (80e-6, 100e-6)], atol=1e-12)
    np.testing.assert_allclose(iv["/cpu:1"], [(15e-6, 80e-6)], atol=1e-12)
    idle = trace.idle_fractions(iv)  # the step spans 0..100 us
    assert idle["/cpu:0"] == pytest.approx(1 - 35 / 100)
    assert idle["/cpu:1"] == pytest.approx(1 - 65 / 100)


def test_empty_stats_are_an_error():
    with pytest.raises(ValueError, match="the run holds no step stats: run with FULL_TRACE"):
        trace.busy_intervals(config_pb2.RunMetadata())
    with pytest.raises(ValueError, match="no busy intervals"):
        trace.idle_fractions({"/cpu:0": []})


def test_transfers_of_a_hand_placed_function(four_devices):
    d0, d1 = four_devices[:2]

    @tf.function
    def f(x):
        with tf.device(d0):
            h = tf.matmul(x, x)  # [6, 6] float32 = 144 bytes
        with tf.device(d1):
            return tf.reduce_sum(h)

    moved = [(t.direction, t.source, t.target, t.shape, t.nbytes)
             for t in trace.transfers_of(f, tf.ones((6, 6))) if not t.control]
    assert ("forward", d0, d1, (6, 6), 144) in moved
    assert trace.crossing_bytes(trace.transfers_of(f, tf.ones((6, 6))))["backward"] == 0
    with pytest.raises(ValueError, match="target must be a callable"):
        trace.transfers_of(42)
