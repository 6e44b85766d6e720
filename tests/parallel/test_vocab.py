"""accel.parallel.vocab against TensorFlow's own embedding lookup and softmax cross-entropy:
values and gradients."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.parallel import vocab as vp

V, H, B = 16, 6, 5


def _close(actual, ref):
    ref = np.asarray(ref)
    np.testing.assert_allclose(actual, ref, rtol=1e-5, atol=1e-6 * np.max(np.abs(ref)))


@pytest.mark.parametrize("n", [2, 4])
def test_embedding_and_its_gradient_equal_tf_lookup(four_devices, n):
    devs = four_devices[:n]
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, H))
    ids = rng.integers(0, V, (B, 3))
    r = rng.standard_normal((B, 3, H))
    full = tf.Variable(table)
    with tf.GradientTape() as tape:
        ref = tf.nn.embedding_lookup(full, ids)
        ref_loss = tf.reduce_sum(ref * r)
    ref_g = tf.convert_to_tensor(tape.gradient(ref_loss, full))
    shards = [tf.Variable(p) for p in np.split(table, n)]
    with tf.GradientTape() as tape:
        outs = vp.vocab_parallel_embedding(collectives.place(ids, devs), shards, devs)
        losses = [tf.reduce_sum(o * r) for o in outs]
    grads = tape.gradient(losses, shards)
    for o in outs:
        _close(o.numpy(), ref.numpy())
    _close(np.concatenate([tf.convert_to_tensor(g).numpy() for g in grads]), ref_g.numpy())


@pytest.mark.parametrize("n", [2, 4])
def test_cross_entropy_and_its_gradient_equal_tf(four_devices, n):
    devs = four_devices[:n]
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((B, V)) * 3
    labels = rng.integers(0, V, B)
    z = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(z)
        ref = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, z)
        ref_loss = tf.reduce_mean(ref)
    ref_g = tape.gradient(ref_loss, z)
    parts = [tf.constant(p) for p in np.split(logits, n, axis=1)]
    with tf.GradientTape() as tape:
        tape.watch(parts)
        outs = vp.vocab_parallel_cross_entropy(parts, collectives.place(labels, devs), devs)
        losses = [tf.reduce_mean(o) for o in outs]
    grads = tape.gradient(losses, parts)
    for o in outs:
        _close(o.numpy(), ref.numpy())
    _close(np.concatenate([g.numpy() for g in grads], axis=1), ref_g.numpy())


def test_bad_input(four_devices):
    with pytest.raises(ValueError, match="vocab=10 is not divisible by n=4 devices"):
        vp.vocab_ranges(10, 4)
    assert vp.vocab_ranges(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="shapes differ across devices"):
        vp.vocab_parallel_embedding(collectives.place(np.zeros(2, np.int32), four_devices[:2]),
                                    [tf.ones((4, 2)), tf.ones((3, 2))], four_devices[:2])
