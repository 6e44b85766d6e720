"""Gradient accumulation against one step on the whole batch (TensorFlow's own gradient and
Keras' Adam), and its peak memory measured against the whole-batch step's."""

import numpy as np
import pytest
import tensorflow as tf

from accel.memory.measure import memory_device, peak_during
from accel.models import keras_mlp, max_difference
from accel.parallel.accumulate import accumulated_gradients, make_accumulating_step
from accel.training import squared_error


def _loss(y, p):
    return squared_error(y, p)


def _data(batch, d_in, d_out, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(batch, d_in)), tf.float64),
            tf.constant(rng.normal(size=(batch, d_out)), tf.float64))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_k_micro_steps_equal_one_big_step(k):
    tf.keras.config.set_dtype_policy("float64")
    try:
        sizes = [6, 16, 3]
        x, y = _data(32, 6, 3)
        ref = keras_mlp(sizes, seed=1)
        acc = keras_mlp(sizes, seed=1)
    finally:
        tf.keras.config.set_dtype_policy("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(_loss(y, ref(x)))
    want = tape.gradient(loss, ref.trainable_variables)
    got = accumulated_gradients(acc, _loss, x, y, k)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-13)
    opt_ref, opt_acc = tf.keras.optimizers.Adam(0.01), tf.keras.optimizers.Adam(0.01)
    step = make_accumulating_step(acc, _loss, opt_acc, k)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(_loss(y, ref(x)))
        opt_ref.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables, strict=False))
        step(x, y)
    assert max_difference(acc.get_weights(), ref.get_weights()) < 1e-12


def test_accumulation_lowers_the_peak():
    model = keras_mlp([32, 512, 512, 8])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2048, 32)), tf.float32)
    y = tf.constant(rng.normal(size=(2048, 8)), tf.float32)
    peaks = {}
    for k in (1, 4):
        step = make_accumulating_step(model, _loss, 1e-3, k)
        step(x, y)
        peaks[k], _ = peak_during(lambda step=step: step(x, y), memory_device())
    # one hidden activation of the whole batch is 2048 * 512 * 4 bytes = 4 MiB
    assert peaks[1] - peaks[4] > 4 * 2**20


def test_bad_input():
    model = keras_mlp([4, 2])
    x, y = tf.ones((6, 4)), tf.ones((6, 2))
    with pytest.raises(ValueError, match="batch size 6 does not split into k=4"):
        accumulated_gradients(model, _loss, x, y, 4)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        make_accumulating_step(model, _loss, 0.1, 0)
