"""Adam offloaded to a host device, partitioned as ZeRO-Offload (ZeRO stage 2 underneath),
against Keras' Adam on one device; bytes held and sent against hand counts."""

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
SIZES = [8, 12, 4]  # 8*12 + 12 + 12*4 + 4 = 160 parameters


@pytest.mark.parametrize("n", [1, 2, 3])
def test_weights_equal_single_device_adam(four_devices, steps_like_adam, n):
    host, accs = four_devices[0], four_devices[1:1 + n]
    params = mlp_init(SIZES, seed=2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 8)), rng.normal(size=(12, 4))
    step = OffloadStep(params, accs, host, squared_error, **HYPER, dtype=tf.float64,
                       model_fn=mlp_apply)
    vs, _, _ = steps_like_adam(step, params, x, y, accs, 4, HYPER, mlp_apply)
    master = np.concatenate([m.numpy() for m in step.master])[:160]
    np.testing.assert_allclose(master, np.concatenate([v.numpy().ravel() for v in vs]),
                               rtol=1e-10, atol=1e-12)
    for device in range(n):  # every accelerator's full copy
        for a, b in zip(step.weights(device), vs, strict=True):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)


def test_bytes_held_and_sent_by_hand(four_devices):
    host, accs = four_devices[0], four_devices[1:]
    step = OffloadStep(mlp_init(SIZES), accs, host, squared_error, model_fn=mlp_apply)
    # 160 float32 parameters padded to 162 (a multiple of 3): 648 bytes, partitions of 216
    assert step.padded_params == 162 and [m.shape[0] for m in step.master] == [54] * 3
    held = step.held_bytes()
    # accelerators: the full weights, 648; host: 3 partitions x (master + m + v) = 3 x 648
    assert held == {accs[0]: 648, accs[1]: 648, accs[2]: 648, host: 1944}
    xs = collectives.place([tf.ones((2, 8))] * 3, accs)
    ys = collectives.place([tf.ones((2, 4))] * 3, accs)
    sent = collectives.sent_bytes(step.step, xs, ys)
    # each accelerator: reduce-scatter 2 x 216, its partition to the host 216, all-gather
    # 2 x 216 = 1080; the host: each accelerator's partition back, 3 x 216 = 648
    assert sent == {host: 648, accs[0]: 1080, accs[1]: 1080, accs[2]: 1080}


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
