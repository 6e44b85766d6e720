"""accel.parallel.tensor's Keras layers and TensorParallel: a Keras Sequential's Dense pairs
converted to column- / row-parallel layers train under Keras's own compile/fit exactly as the
original does on one device (weights after several steps, per step loss), every shard's
variables, optimizer slots, forward and backward matmuls on its own device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel import placement
from accel.parallel import keras_model as km
from accel.parallel import tensor as tp

RULES = {"^up": "column", "^down": "row"}
SLOW = pytest.mark.slow  # make test, not make quick


def mlp(seed=0):
    """Two Megatron pairs: up (column) then down (row), twice."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64", name=name)
        for n, a, name in [(16, "relu", "up1"), (16, "tanh", "down1"), (12, "relu", "up2"),
                           (3, None, "down2")]])


@pytest.mark.parametrize("n,opt", [(2, "adam"), pytest.param(2, "sgd_momentum", marks=SLOW),
                                   pytest.param(4, "adam", marks=SLOW), (4, "sgd_momentum")])
def test_tensor_parallel_fit_equals_keras_on_one_device(four_devices, keras_zoo, n, opt):
    z = keras_zoo
    model = mlp()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    par = tp.TensorParallel(model, four_devices[:n], RULES)
    assert [type(la).__name__ for la in par.layers] == ["ColumnParallelDense",
                                                       "RowParallelDense"] * 2
    assert [la.gather_output for la in par.layers[::2]] == [False, False]  # slices go straight on
    z.assert_close(par.model.predict(x, verbose=0), model.predict(x, verbose=0), "forward")
    par.compile(z.OPTIMIZERS[opt](), "mse")
    history = par.model.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    par.write_back()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i}", scale)
    # shard i's kernel and its optimizer slots on device i
    for layer in par.layers:
        for i, kernel in enumerate(layer.kernels):
            assert km.short_device(kernel.value.device) == four_devices[i]
    slots = {v.path: km.short_device(v.value.device) for v in par.model.optimizer.variables
             if v.path.endswith("_momentum")}
    # the last device: a kernel shard of each of the 4 layers, a bias shard of the 2 column ones
    assert sum(d == four_devices[n - 1] for d in slots.values()) == 4 + 2
    if opt == "adam":
        assert len(slots) == 4 * n + 2 * n + 2  # kernels, column biases, row biases


def test_each_shard_computes_forward_and_backward_on_its_device(four_devices):
    """In the placed graph of a training step: device i runs 3 MatMuls per split layer (the
    forward, the input gradient, the kernel gradient); the first layer's input gradient is not
    needed, so 2 there."""
    model = mlp()
    par = tp.TensorParallel(model, four_devices[:2], RULES)
    variables = par.model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(par.model(x) - y))
        return tape.gradient(loss, variables)

    x, y = tf.ones((4, 6), tf.float64), tf.ones((4, 3), tf.float64)
    table = placement.placement_of(step, x, y)
    matmuls = [r for r in table.rows if r.op_type == "MatMul"]
    assert sum(r.device == four_devices[1] for r in matmuls) == 3 * 4 - 1
    assert sum(r.device == four_devices[0] for r in matmuls) == 3 * 4 - 1
    grads = step(x, y)
    with tf.GradientTape() as tape:  # the same gradients as one device
        loss = tf.reduce_mean(tf.square(model(x) - y))
    ref = tape.gradient(loss, model.trainable_variables)
    got = {w.path: g for w, g in zip(variables, grads, strict=True)}
    full = []
    for layer in par.layers:
        k = [got[w.path].numpy() for w in layer.kernels]
        axis = 1 if isinstance(layer, tp.ColumnParallelDense) else 0
        full.append(np.concatenate(k, axis=axis))
        if isinstance(layer, tp.ColumnParallelDense):
            full.append(np.concatenate([got[b.path].numpy() for b in layer.biases]))
        else:
            full.append(got[layer.bias.path].numpy())
    for a, b in zip(full, ref, strict=True):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)


def test_layers_alone_and_bad_rules(four_devices):
    devices = four_devices[:2]
    keras.utils.set_random_seed(1)
    col = tp.ColumnParallelDense(8, devices, activation="relu", dtype="float64")
    x = tf.constant(np.random.default_rng(0).normal(size=(3, 5)))
    y = col(x)  # gathered: one tensor, as a Dense
    dense = keras.layers.Dense(8, activation="relu", dtype="float64")
    dense(x)
    dense.set_weights(col.full_weights())
    np.testing.assert_allclose(y.numpy(), dense(x).numpy(), rtol=1e-12)
    row = tp.RowParallelDense(4, devices, dtype="float64")
    out = row(y)  # a full tensor is split here along its last axis
    ref = keras.layers.Dense(4, dtype="float64")
    ref(y)
    ref.set_weights(row.full_weights())
    np.testing.assert_allclose(out.numpy(), ref(y).numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="units=6 does not split evenly over 4 devices"):
        tp.ColumnParallelDense(6, four_devices)
    with pytest.raises(ValueError, match="no layer name matches the rules"):
        tp.TensorParallel(mlp(), devices, {"^attn": "column"})
    with pytest.raises(ValueError, match=r"rules\['\^up'\] must be one of"):
        tp.TensorParallel(mlp(), devices, {"^up": "columns"})
    par = tp.TensorParallel(mlp(), devices, RULES)
    with pytest.raises(ValueError, match="jit_compile=True"):
        par.compile("adam", "mse", jit_compile=True)
