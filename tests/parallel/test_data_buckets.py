"""The towers' bucketed gradient averaging (``DataParallel(bucket_bytes=...)``,
``accel.parallel.data.gradient_buckets``): buckets counted by hand, training equal to Keras on
one device, each bucket's sum independent of the earlier layers' backward in the traced graph,
and, read from an executed trace, issued while the backward pass still runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel import profile
from accel.parallel import data as dp

SLOW = pytest.mark.slow


def test_buckets_by_hand():
    """Reverse order, closed before the next variable would pass the cap or changes dtype; a
    variable above the cap alone."""
    vs = [tf.Variable(tf.zeros(s, d)) for s, d in [
        ((10, 10), "float32"),  # 400 bytes
        ((10,), "float32"),     # 40
        ((30, 10), "float32"),  # 1200
        ((10,), "float64"),     # 80
        ((5,), "float64")]]     # 40
    assert dp.gradient_buckets(vs, 500) == [[4, 3], [2], [1, 0]]
    assert dp.gradient_buckets(vs, 10**6) == [[4, 3], [2, 1, 0]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        dp.gradient_buckets(vs, 0)


@pytest.mark.parametrize("opt", ["adam", pytest.param("sgd_momentum", marks=SLOW)])
def test_bucketed_towers_equal_keras_on_one_device(four_devices, keras_zoo, opt):
    z = keras_zoo
    model = z.MODELS["mlp"]()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    towers = dp.DataParallel(model, four_devices[:4], loss="mse", optimizer=z.OPTIMIZERS[opt](),
                             bucket_bytes=600)  # several buckets of whole variables
    assert len(towers._tower_step.buckets) > 2
    history = towers.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i}", scale)


def _deep(devices, depth=8, width=256):
    keras.utils.set_random_seed(0)
    with tf.device(devices[0]):
        return keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu", name=f"d{i}") for i in range(depth)]
            + [keras.layers.Dense(1, name="out")])


def _step(model, devices, bucket_bytes):
    return dp.make_tower_step(None, keras.losses.MeanSquaredError(reduction=None), model, 0.01,
                              devices, bucket_bytes=bucket_bytes)


def _ancestors(op) -> set[str]:
    seen, todo = set(), [op]
    while todo:
        for t in todo.pop().inputs:
            if t.op.name not in seen:
                seen.add(t.op.name)
                todo.append(t.op)
    return seen


def test_each_bucket_waits_only_for_its_own_gradients(four_devices):
    """In the traced step, the first bucket's sum (the last layers' gradients) has no gradient
    op of the first layer among its inputs, however far back; with one bucket for everything,
    it has."""
    devices = four_devices[:2]
    model = _deep(devices, depth=3, width=16)
    x, y = tf.ones((8, 16)), tf.zeros((8, 1))
    for bucket_bytes, waits in ((16 * 16 * 4 + 16 * 4, False), (10**9, True)):
        graph = _step(model, devices, bucket_bytes).get_concrete_function(x, y).graph
        first = graph.get_operation_by_name("bucket_0/AddN")
        d0 = {n for n in _ancestors(first) if n.startswith("gradient_tape/") and "/d0" in n
              and n.endswith("MatMul")}
        assert bool(d0) is waits, (bucket_bytes, sorted(d0))


@SLOW
def test_the_trace_shows_a_bucket_summed_during_the_backward(four_devices, tmp_path):
    """Read from an executed trace (``accel.profile.op_runs``): with a bucket per layer, the
    first bucket's sum starts before the towers' backward has finished, in at least one of three
    steps (the executor may run it late, never early); with one bucket, the sum starts after
    every backward matmul of every tower has ended, in all three."""
    devices = four_devices[:2]
    model = _deep(devices)
    x = tf.constant(np.random.default_rng(0).normal(size=(512, 256)).astype("float32"))
    y = tf.zeros((512, 1))
    for bucket_bytes, overlaps in ((256 * 256 * 4 + 256 * 4, True), (10**9, False)):
        step = _step(model, devices, bucket_bytes)
        step(x, y)
        seen = []
        for k in range(3):
            runs = profile.op_runs(profile.profile_trace(lambda step=step: step(x, y),
                                                         str(tmp_path / f"{bucket_bytes}_{k}")))
            backward = [r.end for r in runs if r.name.startswith("gradient_tape/tower_")
                        and "MatMul" in r.type]
            summed = [r.start for r in runs if r.name == "bucket_0/AddN"]
            assert backward and len(summed) == 1
            seen.append(summed[0] < max(backward))
        assert any(seen) if overlaps else not any(seen), (bucket_bytes, seen)
