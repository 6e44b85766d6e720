"""Adam offloaded to a host device against Keras' Adam on one device; bytes held and sent
against hand counts."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.models import mlp_apply, mlp_init
from accel.parallel.offload import OffloadStep
from accel.training import squared_error

# Keras' Adam rounds its learning rate and betas to float32 even for float64 variables: values
# exact in float32 make the float64 reference exact
HYPER = {"learning_rate": 2**-7, "beta_1": 0.875, "beta_2": 1 - 2**-10}
SIZES = [8, 12, 4]  # 160 parameters


def test_weights_equal_single_device_adam(four_devices):
    host, accs = four_devices[0], four_devices[1:]
    params = mlp_init(SIZES, seed=2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 8)), rng.normal(size=(12, 4))
    vs = [tf.Variable(p.astype(np.float64)) for p in params]
    opt = tf.keras.optimizers.Adam(**HYPER)
    step = OffloadStep(params, accs, host, squared_error, **HYPER, dtype=tf.float64,
                       model_fn=mlp_apply)
    xs = collectives.place(list(np.split(x, 3)), accs)
    ys = collectives.place(list(np.split(y, 3)), accs)
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(y, mlp_apply(vs, x)))
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs, strict=False))
        got = float(sum(v.numpy() for v in step.step(xs, ys)))
        assert got == pytest.approx(float(loss), rel=1e-12)
    for copy in [step.master, *step.weights_on]:
        for a, b in zip(copy, vs, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


def test_bytes_held_and_sent_by_hand(four_devices):
    host, accs = four_devices[0], four_devices[1:]
    step = OffloadStep(mlp_init(SIZES), accs, host, squared_error, model_fn=mlp_apply)
    held = step.held_bytes()
    # accelerators: 160 float32 weights = 640 bytes; host: master 640 + m, v 1280
    assert held == {accs[0]: 640, accs[1]: 640, accs[2]: 640, host: 1920}
    xs = collectives.place([tf.ones((2, 8))] * 3, accs)
    ys = collectives.place([tf.ones((2, 4))] * 3, accs)
    sent = collectives.sent_bytes(step.step, xs, ys)
    # gradients up: 640 from each accelerator; weights down: 3 * 640 from the host
    assert sent == {host: 1920, accs[0]: 640, accs[1]: 640, accs[2]: 640}


def test_bad_input(four_devices):
    with pytest.raises(ValueError, match="more than once"):
        OffloadStep(mlp_init(SIZES), four_devices[:2], four_devices[0], squared_error,
                    model_fn=mlp_apply)
    with pytest.raises(ValueError, match="learning_rate must be a number > 0"):
        OffloadStep(mlp_init(SIZES), four_devices[1:], four_devices[0], squared_error,
                    learning_rate=-1.0, model_fn=mlp_apply)
    with pytest.raises(ValueError, match="model_fn must be a function"):
        OffloadStep(mlp_init(SIZES), four_devices[1:], four_devices[0], squared_error,
                    model_fn=None)
