"""accel.parallel.data, mirrored, inputs:
every parallel variant is compared with the single-device step on the whole batch; placement is
checked with accel.placement."""

import os

import numpy as np
import pytest
import tensorflow as tf

from accel import datasets, models
from accel.parallel import data as dp
from accel.parallel import inputs as tfrecords
from accel.parallel.mirrored import make_mirrored_step, mirrored_strategy
from accel.placement import placement_of
from accel.training import squared_error

SIZES = [8, 16, 1]
LR = 0.05
BATCH = 64
STEPS = 3


@pytest.fixture(scope="module")
def problem():
    x, y, _ = datasets.regression(BATCH * STEPS, SIZES[0], SIZES[-1], seed=1)
    return x, y


def batches(x, y):
    return [(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]) for k in range(STEPS)]


def train(step, x, y):
    for xb, yb in batches(x, y):
        step(xb, yb)
    return [v.numpy() for v in step.variables]


@pytest.fixture(scope="module")
def reference(problem, four_devices):
    """Weights after STEPS single-device SGD steps on whole batches."""
    step = dp.make_single_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                               four_devices[0])
    return train(step, *problem)


def assert_weights(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- split_batch
def test_split_batch_even_and_nested():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6, dtype=np.float32)
    shards = dp.split_batch((x, y), 3)
    assert len(shards) == 3
    for i, (xs, ys) in enumerate(shards):
        np.testing.assert_array_equal(xs.numpy(), x[2 * i:2 * i + 2])
        np.testing.assert_array_equal(ys.numpy(), y[2 * i:2 * i + 2])
    assert [s["a"].shape[0] for s in dp.split_batch({"a": x}, 2)] == [3, 3]


def test_split_batch_uneven_is_an_error_naming_the_sizes():
    with pytest.raises(ValueError, match=r"batch of 10 .* 4 shards .*\[3, 3, 2, 2\]"):
        dp.split_batch(np.zeros((10, 3)), 4)


def test_split_batch_drop_and_pad():
    x = np.arange(10, dtype=np.float32)
    dropped = dp.split_batch(x, 4, remainder="drop")
    assert [s.shape[0] for s in dropped] == [2, 2, 2, 2]
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in dropped]), x[:8])
    padded = dp.split_batch(x, 4, remainder="pad")
    assert [s.shape[0] for s in padded] == [3, 3, 3, 3]
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in padded]),
                                  np.concatenate([x, x[:2]]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be an int >= 1, got 0"),
    (dict(n=2, remainder="spread"), r"remainder must be one of .* got .spread."),
])
def test_split_batch_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dp.split_batch(np.zeros((4, 1)), **kwargs)


def test_split_batch_mismatched_sizes_and_unknown_size():
    with pytest.raises(ValueError, match="same leading size"):
        dp.split_batch((np.zeros((4, 1)), np.zeros((5, 1))), 2)
    with pytest.raises(ValueError, match="batch is empty"):
        dp.split_batch(np.zeros((0, 3)), 2)
    with pytest.raises(ValueError, match="cannot split a scalar"):
        dp.split_batch(np.float32(1.0), 2)

    @tf.function(input_signature=[tf.TensorSpec([None, 2])])
    def f(x):
        return dp.split_batch(x, 2)

    with pytest.raises(ValueError, match="batch size must be known"):
        f.get_concrete_function()


# ----------------------------------------------------------------------------- average_gradients
def test_average_gradients_mean_and_none():
    v0, v1, v2 = (tf.Variable(np.zeros(2, np.float32)) for _ in range(3))
    g = [np.array([1.0, 2.0], np.float32), np.array([3.0, 6.0], np.float32)]
    towers = [[(g[0], v0), (None, v1), (g[0], v2)],
              [(g[1], v0), (None, v1), (None, v2)]]
    (a0, w0), (a1, w1), (a2, w2) = dp.average_gradients(towers)
    assert (w0, w1, w2) == (v0, v1, v2)
    np.testing.assert_allclose(a0.numpy(), [2.0, 4.0])
    assert a1 is None  # None on every tower
    np.testing.assert_allclose(a2.numpy(), g[0] / 2)  # a missing gradient counts as zero
    (_, _), (s1, _), (s2, _) = dp.average_gradients(towers, missing="skip")
    assert s1 is None
    np.testing.assert_allclose(s2.numpy(), g[0])  # mean over the towers that have one
    with pytest.raises(ValueError, match="missing must be one of"):
        dp.average_gradients(towers, missing="mean")


def test_average_gradients_zero_equals_whole_batch_gradient():
    """A variable used only for some examples: "zero" gives the whole-batch gradient."""
    v, w = tf.Variable(1.0), tf.Variable(3.0)
    x = tf.constant([1.0, 2.0, 3.0, 4.0])
    uses_w = tf.constant([0.0, 0.0, 1.0, 1.0])  # only tower 1's examples touch w

    def loss(xs, mask):
        return tf.reduce_mean(v * xs + tf.where(mask > 0, w * xs, 0.0))

    with tf.GradientTape() as tape:
        whole = loss(x, uses_w)
    expected = tape.gradient(whole, [v, w])
    towers = []
    for xs, mask in dp.split_batch((x, uses_w), 2):
        with tf.GradientTape() as tape:
            part = loss(xs, mask) if float(tf.reduce_sum(mask)) else tf.reduce_mean(v * xs)
        towers.append(list(zip(tape.gradient(part, [v, w]), [v, w], strict=True)))
    assert towers[0][1][0] is None and towers[1][1][0] is not None
    got = [g.numpy() for g, _ in dp.average_gradients(towers)]
    np.testing.assert_allclose(got, [e.numpy() for e in expected], rtol=1e-6)


def test_average_gradients_indexed_slices_made_dense():
    v = tf.Variable(np.zeros((3, 2), np.float32))
    s = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    ((avg, _),) = dp.average_gradients([[(s, v)], [(tf.zeros((3, 2)), v)]])
    np.testing.assert_allclose(avg.numpy(), [[0, 0], [0.5, 0.5], [0, 0]])


def test_average_gradients_errors():
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    with pytest.raises(ValueError, match="tower_grads is empty: need one"):
        dp.average_gradients([])
    with pytest.raises(ValueError, match=r"got lists of lengths \[1, 2\]"):
        dp.average_gradients([[(1.0, v)], [(1.0, v), (1.0, w)]])
    with pytest.raises(ValueError, match="position 0: the towers list different variables"):
        dp.average_gradients([[(1.0, v)], [(1.0, w)]])


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("n", [1, 2, 4])
def test_towers_equal_single_device_step(n, problem, reference, four_devices):
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              four_devices[:n])
    assert_weights(train(step, *problem), reference)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_custom_loop_equals_single_device_step(n, problem, reference, four_devices):
    strategy = mirrored_strategy(four_devices[:n])
    with strategy.scope():
        model = models.keras_mlp(SIZES)
        optimizer = tf.keras.optimizers.SGD(LR)
    step = make_mirrored_step(strategy, model, squared_error, optimizer, BATCH)
    ds = tf.data.Dataset.from_tensor_slices(problem).batch(BATCH)
    for batch in strategy.experimental_distribute_dataset(ds):
        step(batch)
    assert_weights(model.get_weights(), reference)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_keras_fit_equals_single_device_step(n, problem, reference, four_devices):
    with mirrored_strategy(four_devices[:n]).scope():
        model = models.keras_mlp(SIZES)
        model.compile(tf.keras.optimizers.SGD(LR), loss="mse")
    model.fit(*problem, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights(model.get_weights(), reference)


def test_towers_with_keras_model_and_momentum_equal_keras_fit(problem, four_devices):
    """A Keras model and a stateful Keras optimizer (momentum): towers on 4 devices against
    Keras' own training loop on one device (``fit``, whole batches, no shuffling)."""
    with tf.device(four_devices[0]):
        model = models.keras_mlp(SIZES)
    step = dp.make_tower_step(None, squared_error, model, tf.keras.optimizers.SGD(LR, momentum=0.9),
                              four_devices)
    towers = train(step, *problem)
    with tf.device(four_devices[0]):
        fitted = models.keras_mlp(SIZES)
        fitted.compile(tf.keras.optimizers.SGD(LR, momentum=0.9), loss="mse")
        fitted.fit(*problem, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights(towers, fitted.get_weights())


def test_presplit_shards_of_unequal_size_equal_whole_batch(problem, reference, four_devices):
    """Shards of 48 and 16 examples: each tower's gradient weighs by its share (3/4, 1/4), so the
    update is still the whole batch's (equal weights would give the 16 examples 3x their due)."""
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              four_devices[:2])
    for xb, yb in batches(*problem):
        step((xb[:48], xb[48:]), (yb[:48], yb[48:]))
    assert_weights([v.numpy() for v in step.variables], reference)


def test_average_gradients_with_weights():
    v = tf.Variable(0.0)
    pairs = [[(tf.constant(4.0), v)], [(tf.constant(8.0), v)], [(None, v)]]
    ((zero, _),) = dp.average_gradients(pairs, weights=[0.5, 0.25, 0.25])
    assert float(zero) == 4.0  # 0.5 * 4 + 0.25 * 8 (+ 0.25 * 0)
    ((skip, _),) = dp.average_gradients(pairs, missing="skip", weights=[0.5, 0.25, 0.25])
    assert float(skip) == pytest.approx(4.0 / 0.75)
    with pytest.raises(ValueError, match="weights has 2 entries for 3 towers"):
        dp.average_gradients(pairs, weights=[0.5, 0.5])


def test_presplit_shards_equal_whole_batch(problem, reference, four_devices):
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              four_devices[:2])
    for xb, yb in batches(*problem):
        (x0, y0), (x1, y1) = dp.split_batch((xb, yb), 2)
        step((x0, x1), (y0, y1))
    assert_weights([v.numpy() for v in step.variables], reference)


def test_tower_step_uneven_batch(problem, four_devices):
    x, y = problem
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              four_devices[:4])
    with pytest.raises(ValueError, match="does not split evenly"):
        step(x[:10], y[:10])
    padded = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                                four_devices[:4], remainder="pad")
    padded(x[:10], y[:10])
    # == one device on the batch padded by hand: the first 2 examples repeated (12 = 4 x 3)
    by_hand = dp.make_single_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                                  four_devices[0])
    by_hand(np.concatenate([x[:10], x[:2]]), np.concatenate([y[:10], y[:2]]))
    assert_weights([v.numpy() for v in padded.variables], [v.numpy() for v in by_hand.variables])


def test_tower_step_bad_arguments(four_devices):
    with pytest.raises(ValueError, match="devices is empty"):
        dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR, [])
    with pytest.raises(ValueError, match="cannot parse"):
        dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                           ["/gpu:x"])
    with pytest.raises(ValueError, match="a learning rate must be a number > 0, got -1.0"):
        dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), -1.0,
                           four_devices)
    with pytest.raises(ValueError, match="model_fn is required"):
        dp.make_tower_step(None, squared_error, models.mlp_init(SIZES), LR, four_devices)
    on_one = dp.make_variables(models.mlp_init(SIZES), four_devices[1])
    with pytest.raises(ValueError, match="lives on .*CPU:1.*not on the variable device"):
        dp.make_tower_step(models.mlp_apply, squared_error, on_one, LR, four_devices,
                           variable_device=four_devices[0])
    with tf.device(four_devices[2]):
        model = models.keras_mlp(SIZES)
    with pytest.raises(ValueError, match="CPU:2"):
        dp.make_tower_step(None, squared_error, model, LR, four_devices)


# ----------------------------------------------------------------------------- placement
def test_placement_variables_and_towers(problem, four_devices):
    """Docstring promise: variables, their reads and the update on variable_device; each
    tower's MatMuls on its own device."""
    var_dev, towers = four_devices[0], four_devices[1:]
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              towers, variable_device=var_dev)
    table = placement_of(step, tf.constant(problem[0][:BATCH - 1]),
                         tf.constant(problem[1][:BATCH - 1]))
    assert table.devices() == sorted(four_devices)
    applies = [r for r in table.rows if r.op_type == "ResourceApplyGradientDescent"]
    assert len(applies) == len(step.variables)
    assert {r.device for r in applies} == {var_dev}
    reads = [r for r in table.rows if r.op_type == "ReadVariableOp"]
    assert reads and {r.device for r in reads} == {var_dev}
    assert all(v.device.endswith(var_dev) for v in step.variables)
    averages = [r for r in table.rows if r.op_type == "AddN"]
    assert averages and all(r.name.startswith("update/") for r in averages)
    assert {r.device for r in averages} == {var_dev}
    for i, dev in enumerate(towers):
        matmuls = [r for r in table.rows if r.op_type == "MatMul" and f"tower_{i}/" in r.name]
        assert len(matmuls) == 5  # 2 forward + 3 backward (no gradient w.r.t. the input)
        assert {r.device for r in matmuls} == {dev}
        # every op of the tower runs on its device, except the variable reads and the transfers
        elsewhere = {r.op_type for r in table.rows
                     if f"tower_{i}/" in r.name and r.device != dev}
        assert elsewhere <= {"ReadVariableOp", "_Send", "_Recv"}, elsewhere
        assert not [r for r in table.ops_on(dev) if r.op_type == "ResourceApplyGradientDescent"]


# ----------------------------------------------------------------------------- TFRecords
def test_tfrecords_roundtrip_in_order_and_cleaned_up():
    x, y, _ = datasets.regression(40, 5, 2, seed=3)
    with tfrecords.temporary_tfrecords(x, y, num_files=3) as files:
        assert len(files) == 3 and all(os.path.exists(f) for f in files)
        got = list(tfrecords.tfrecord_dataset(files, 5, 2, batch_size=8))
        split = list(tfrecords.tfrecord_dataset(files, 5, 2, batch_size=8, towers=4))
    assert not any(os.path.exists(f) for f in files)
    assert len(got) == 5
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in got]), x)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in got]), y)
    xs, ys = split[0]
    assert len(xs) == len(ys) == 4 and xs[0].shape == (2, 5) and ys[3].shape == (2, 2)
    np.testing.assert_array_equal(np.concatenate([t.numpy() for t in xs]), x[:8])


def test_tfrecords_errors(tmp_path):
    with pytest.raises(ValueError, match="same number of rows"):
        tfrecords.write_tfrecords(np.zeros((3, 2)), np.zeros((4, 1)), tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        tfrecords.write_tfrecords(np.zeros((3, 2)), np.zeros((3, 1)), tmp_path / "nope")
    with pytest.raises(ValueError, match="batch_size 10 must be a positive multiple of towers=4"):
        tfrecords.tfrecord_dataset(["a"], 2, batch_size=10, towers=4)
    with pytest.raises(ValueError, match="files is empty"):
        tfrecords.tfrecord_dataset([], 2)


def test_tfrecord_dataset_takes_one_file_name(tmp_path):
    x, y, _ = datasets.regression(12, 3, 1, seed=4)
    (name,) = tfrecords.write_tfrecords(x, y, tmp_path, num_files=1)
    for one in (name, tmp_path / name.split("/")[-1]):
        got = list(tfrecords.tfrecord_dataset(one, 3, 1, batch_size=12))
        np.testing.assert_array_equal(got[0][0].numpy(), x)


def test_towers_on_tfrecord_pipeline_equal_reference(problem, reference, four_devices):
    step = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init(SIZES), LR,
                              four_devices)
    with tfrecords.temporary_tfrecords(*problem, num_files=4) as files:
        for xs, ys in tfrecords.tfrecord_dataset(files, SIZES[0], SIZES[-1], BATCH, towers=4):
            step(xs, ys)
    assert_weights([v.numpy() for v in step.variables], reference)


# ----------------------------------------------------------------------------- scaling helpers
def test_linear_rule_and_final_loss_inputs():
    assert dp.scaled_learning_rate(0.1, 256, 8192) == pytest.approx(3.2)
    with pytest.raises(ValueError, match="base_batch must be an int >= 1, got 0"):
        dp.scaled_learning_rate(0.1, 0, 8)
