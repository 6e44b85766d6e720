"""The ring all-reduce against NumPy (any size, n = 1, 2, 3, 4), its schedule against a table
written by hand, its gradient against the exact one, its bytes against the sends that ran."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives


def _arrays(n, shape, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def test_chunk_sizes_and_schedule_by_hand():
    assert collectives.chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert collectives.chunk_sizes(3, 4) == [1, 1, 1, 0]
    assert collectives.chunk_sizes(8, 1) == [8]
    # n = 3: reduce-scatter steps, then all-gather steps; (sender, receiver, chunk)
    assert collectives.ring_sends(3) == [
        [(0, 1, 0), (1, 2, 1), (2, 0, 2)],
        [(0, 1, 2), (1, 2, 0), (2, 0, 1)],
        [(0, 1, 1), (1, 2, 2), (2, 0, 0)],
        [(0, 1, 0), (1, 2, 1), (2, 0, 2)],
    ]
    assert collectives.ring_sends(1) == []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2,), (4, 2, 2)])
def test_ring_matches_numpy_for_any_size(four_devices, n, shape):
    devs = four_devices[:n]
    arrays = _arrays(n, shape)
    out = collectives.all_reduce(collectives.place(arrays, devs), devs, algorithm="ring")
    for y, d in zip(out, devs, strict=True):
        assert y.shape == shape
        assert y.device.endswith(d.split("device:")[-1])
        np.testing.assert_allclose(y.numpy(), np.sum(arrays, axis=0), rtol=1e-12)
    assert all(np.array_equal(out[0].numpy(), y.numpy()) for y in out)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_gradient_is_exact_and_mean_divides(four_devices, n):
    devs = four_devices[:n]
    xs = collectives.place(_arrays(n, (5, 3)), devs)
    ws = _arrays(n, (5, 3), seed=1)

    @tf.function
    def grads(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = collectives.all_reduce(xs, devs, algorithm="ring", op="mean")
            loss = [tf.reduce_sum(y * w) for y, w in zip(ys, ws, strict=True)]
        return ys, tape.gradient(loss, xs)

    ys, gs = grads(xs)
    for y, g in zip(ys, gs, strict=True):
        np.testing.assert_allclose(y.numpy(), np.mean([x.numpy() for x in xs], axis=0),
                                   rtol=1e-12)
        np.testing.assert_allclose(g.numpy(), np.sum(ws, axis=0) / n, rtol=1e-12)


@pytest.mark.parametrize("n,count", [(2, 64), (4, 64), (4, 10), (3, 7)])
def test_ring_bytes_counted_equal_the_formula(four_devices, n, count):
    devs = four_devices[:n]
    xs = collectives.place(_arrays(n, (count,), dtype=np.float32), devs)
    sent = collectives.sent_bytes(lambda xs: collectives.all_reduce(xs, devs, "ring"), xs)
    per_device = collectives.all_reduce_bytes_per_device(4 * count, n, "ring", itemsize=4)
    assert sent == dict(zip(devs, per_device, strict=True))
    if count % n == 0:  # 2 (n - 1) / n * S, by hand: n = 4, S = 256 bytes -> 384
        assert set(per_device) == {2 * (n - 1) * 4 * count // n}
        assert collectives.all_reduce_bytes(4 * count, n, "ring") == 2 * (n - 1) * 4 * count // n
    if (n, count) == (4, 10):  # chunks of 3, 3, 2, 2 elements; device i sends every chunk
        # but chunk i+1 in the reduce-scatter, every chunk but chunk i+2 in the all-gather
        assert per_device == [4 * (7 + 8), 4 * (8 + 8), 4 * (8 + 7), 4 * (7 + 7)]
