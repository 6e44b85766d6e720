"""Buckets against hand-written tables; packed and float16 all-reduces against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives


def test_pack_buckets_by_hand():
    assert collectives.pack_buckets([4, 4, 4, 30, 1], 10) == [[0, 1], [2], [3], [4]]
    assert collectives.pack_buckets([4, 4, 4], 0) == [[0], [1], [2]]
    assert collectives.pack_buckets([4, 4, 4], 100) == [[0, 1, 2]]
    assert collectives.pack_buckets([], 10) == []
    with pytest.raises(ValueError, match="pack_bytes"):
        collectives.pack_buckets([1], -1)


@pytest.mark.parametrize("pack", [0, 40, 1 << 20])
def test_packed_all_reduce_matches_numpy(four_devices, pack):
    rng = np.random.default_rng(0)
    shapes = [(3,), (2, 4), (5,), (1,)]
    arrays = [[rng.standard_normal(s) for s in shapes] for _ in four_devices]
    per_device = []
    for arrs, d in zip(arrays, four_devices, strict=True):
        with tf.device(d):
            per_device.append([tf.constant(a) for a in arrs])
    out, calls = collectives.packed_all_reduce(per_device, four_devices, pack, "ring")
    assert calls == len(collectives.pack_buckets([8 * int(np.prod(s)) for s in shapes], pack))
    for ys in out:
        for k, y in enumerate(ys):
            np.testing.assert_allclose(y.numpy(), np.sum([a[k] for a in arrays], axis=0),
                                       rtol=1e-12)


def test_float16_halves_the_bytes(four_devices):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(64).astype(np.float32) for _ in four_devices]
    xs = collectives.place(arrays, four_devices)
    out = collectives.compressed_all_reduce(xs, four_devices)
    ref = np.sum(np.float64(arrays), axis=0)
    assert out[0].dtype == tf.float32
    np.testing.assert_allclose(out[0].numpy(), ref, rtol=0, atol=5e-3 * np.abs(ref).max())
    full = collectives.sent_bytes(lambda xs: collectives.all_reduce(xs, four_devices, "ring"), xs)
    half = collectives.sent_bytes(lambda xs: collectives.compressed_all_reduce(xs, four_devices),
                                  xs)
    assert half == {d: b // 2 for d, b in full.items()}
    assert full == {d: 2 * 3 * 64 * 4 // 4 for d in four_devices}
