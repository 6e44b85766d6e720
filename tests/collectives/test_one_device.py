"""Reduce, broadcast and the all-reduce through one device against NumPy, their gradients
against the exact ones, their bytes against the sends that ran."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives


def _arrays(n, shape=(4, 3), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_and_broadcast_match_numpy_with_exact_gradients(four_devices, n):
    devs = four_devices[:n]
    arrays = _arrays(n)
    xs = collectives.place(arrays, devs)
    w = _arrays(1, seed=1)[0]
    ws = _arrays(n, seed=2)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        total = collectives.reduce(xs, devs, root=n - 1)
        copies = collectives.broadcast(xs[0], devs)
        lr = tf.reduce_sum(total * w)
        lb = [tf.reduce_sum(y * v) for y, v in zip(copies, ws, strict=True)]
    assert total.device.endswith(devs[-1].split("device:")[-1])
    np.testing.assert_allclose(total.numpy(), np.sum(arrays, axis=0), rtol=1e-12)
    for y, d in zip(copies, devs, strict=True):
        assert y.device.endswith(d.split("device:")[-1])
        np.testing.assert_array_equal(y.numpy(), arrays[0])
    for g in tape.gradient(lr, xs):  # d/dx_i <w, sum_j x_j> = w on every device
        np.testing.assert_array_equal(g.numpy(), w)
    np.testing.assert_allclose(tape.gradient(lb, xs[0]).numpy(), np.sum(ws, axis=0),
                               rtol=1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_one_device_all_reduce_and_its_bytes(four_devices, n):
    devs = four_devices[:n]
    arrays = [a.astype(np.float32) for a in _arrays(n, (8, 4))]
    xs = collectives.place(arrays, devs)
    out = collectives.all_reduce(xs, devs, algorithm="one_device")
    for y in out:
        np.testing.assert_allclose(y.numpy(), np.sum(np.float64(arrays), axis=0), rtol=1e-5,
                                   atol=1e-6 * np.abs(np.sum(arrays, axis=0)).max())
    sent = collectives.sent_bytes(lambda xs: collectives.all_reduce(xs, devs, "one_device"), xs)
    # the centre sends (n - 1) * S, every other device S (S = 8 * 4 * 4 = 128 bytes)
    assert sent == {devs[0]: (n - 1) * 128, **{d: 128 for d in devs[1:]}}
    assert sent == dict(zip(devs, collectives.all_reduce_bytes_per_device(128, n, "one_device"),
                            strict=True))
    received = collectives.sent_bytes(lambda xs: collectives.reduce(xs, devs), xs)
    assert sum(received.values()) == (n - 1) * 128  # what the centre receives


def test_bad_root(four_devices):
    with pytest.raises(ValueError, match=r"root must be a device index in \[0, 1\], got 2"):
        collectives.reduce([tf.ones(2), tf.ones(2)], four_devices[:2], root=2)
