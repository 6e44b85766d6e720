"""accel.parallel.strategies: every synchronous strategy, trained by the one custom loop, ends with
the weights of a plain single-device loop written out here (same global batches, SGD)."""

import numpy as np
import pytest
import tensorflow as tf

from accel import datasets, models
from accel.parallel import strategies as st
from accel.training import squared_error

SIZES = [8, 16, 1]
LR = 0.1
BATCH = 32
STEPS = 5


@pytest.fixture(scope="module")
def problem():
    x, y, _ = datasets.regression(BATCH * 4, SIZES[0], SIZES[-1], seed=3)
    return x, y


def reference(x, y, l2=0.0):
    """One device, the whole global batch, plain SGD: independent of tf.distribute."""
    model = models.keras_mlp(SIZES)
    per_epoch = len(x) // BATCH
    losses = []
    for k in range(STEPS):
        j = k % per_epoch
        xb, yb = x[j * BATCH:(j + 1) * BATCH], y[j * BATCH:(j + 1) * BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(yb, model(xb)))
            loss += l2 * tf.add_n([tf.reduce_sum(tf.square(w)) for w in model.trainable_weights
                                   if len(w.shape) == 2])
        grads = tape.gradient(loss, model.trainable_weights)
        for g, w in zip(grads, model.trainable_weights, strict=True):
            w.assign_sub(LR * g)
        losses.append(float(loss))
    return [w.numpy() for w in model.weights], losses


def assert_close(actual, ref):
    for a, r in zip(actual, ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6 * np.max(np.abs(r)) + 1e-7)


CASES = [("default", 1, None, "dataset"), ("one_device", 1, None, "function"),
         # TF's default (collective all-reduce) with 4 replicas only: see accel.parallel.mirrored
         ("mirrored", 4, None, "dataset"),
         ("mirrored", 2, "reduction_to_one_device", "function"),
         ("mirrored", 3, "reduction_to_one_device", "dataset"),  # 32 = 11 + 11 + 10
         ("mirrored", 4, "hierarchical_copy", "function"), ("mirrored", 2, "hierarchical_copy",
                                                            "dataset"),
         ("central_storage", 2, None, "dataset"), ("central_storage", 4, None, "function")]


@pytest.fixture(scope="module")
def ref(problem):
    return reference(*problem, l2=0.01)


@pytest.mark.parametrize("kind,n,xops,inputs", CASES)
def test_every_strategy_equals_one_device(problem, ref, four_devices, kind, n, xops, inputs):
    x, y = problem
    ref_weights, ref_losses = ref
    strategy = st.make_strategy(kind, four_devices[:n], xops)
    assert strategy.num_replicas_in_sync == n
    result = st.train_loop(strategy, lambda: models.keras_mlp(SIZES), x, y, BATCH, STEPS, LR,
                           l2=0.01, inputs=inputs)
    assert_close(result.weights, ref_weights)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(result.mean_loss, np.mean(ref_losses), rtol=1e-5)


def test_strategy_kinds_are_the_tensorflow_classes(four_devices):
    assert st.make_strategy("default", four_devices[:1]) is tf.distribute.get_strategy()
    assert isinstance(st.make_strategy("one_device", four_devices[1:2]),
                      tf.distribute.OneDeviceStrategy)
    central = st.make_strategy("central_storage", four_devices)
    assert isinstance(central, tf.distribute.experimental.CentralStorageStrategy)
    with central.scope():
        v = tf.Variable(1.0)
    assert v.device.endswith("CPU:0")  # variables kept once, on the CPU
    mirrored = st.make_strategy("mirrored", four_devices[:2], "reduction_to_one_device")
    with mirrored.scope():
        w = tf.Variable(1.0)
    assert sorted(t.device for t in w.values) == sorted(
        "/job:localhost/replica:0/task:0" + d for d in four_devices[:2])
    for name, cls in [("reduction_to_one_device", tf.distribute.ReductionToOneDevice),
                      ("hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce)]:
        assert isinstance(st.make_cross_device_ops(name, four_devices), cls)


def test_tensorflow_hierarchical_copy_drops_a_replica_with_odd_counts(problem, ref, four_devices):
    """Why make_strategy refuses hierarchical_copy on 3 devices: TensorFlow's own class trains
    to other weights than one device there (two groups of 3 // 2 = 1 replica)."""
    x, y = problem
    strategy = tf.distribute.MirroredStrategy(four_devices[:3],
                                              tf.distribute.HierarchicalCopyAllReduce())
    result = st.train_loop(strategy, lambda: models.keras_mlp(SIZES), x, y, BATCH, STEPS, LR,
                           l2=0.01)
    assert models.max_difference(result.weights, ref[0]) > 1e-2
    with pytest.raises(ValueError, match="even number of devices, got 3"):
        st.make_strategy("mirrored", four_devices[:3], "hierarchical_copy")


def test_default_kind_outside_a_scope_only(four_devices):
    with st.make_strategy("one_device", four_devices[:1]).scope():
        with pytest.raises(ValueError, match="outside any strategy.scope"):
            st.make_strategy("default", four_devices[:1])


@pytest.mark.parametrize("args,match", [
    (("parameter_server", ["/device:CPU:0"]), "kind must be one of"),
    (("mirrored", []), "devices is empty"),
    (("mirrored", ["/device:CPU:0", "/cpu:0"]), "repeats a device"),
    (("one_device", ["/device:CPU:0", "/device:CPU:1"]), "runs on one device"),
    (("default", ["/device:CPU:0", "/device:CPU:1"]), "runs on one device"),
    (("central_storage", ["/device:CPU:0"], "nccl"), "mirrored' only"),
    (("mirrored", ["/device:CPU:0"], "ring"), "cross_device_ops must be one of"),
    (("mirrored", ["/device:CPU:0", "/device:CPU:1"], "nccl"), "needs GPUs"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        st.make_strategy(*args)


def test_loop_rejects_bad_input(problem, four_devices):
    x, y = problem
    strategy = st.make_strategy("mirrored", four_devices[:3], "reduction_to_one_device")
    make = lambda: models.keras_mlp(SIZES)  # noqa: E731
    with pytest.raises(ValueError, match="does not split evenly over 3 replicas"):
        st.train_loop(strategy, make, x, y, BATCH, STEPS, inputs="function")
    with pytest.raises(ValueError, match="inputs must be one of"):
        st.train_loop(strategy, make, x, y, 30, STEPS, inputs="numpy")
    with pytest.raises(ValueError, match="larger than the data"):
        st.train_loop(strategy, make, x[:24], y[:24], 30, STEPS)
    with pytest.raises(ValueError, match="differ in length"):
        st.train_loop(strategy, make, x, y[:-1], 30, STEPS)
