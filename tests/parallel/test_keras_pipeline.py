"""accel.parallel.pipeline_exec.Pipeline on Keras models the library did not build, checked
against Keras training the same model on one device (same optimizer, same data): losses,
gradients of the first step and weights after several steps; the trained weights end up in the
user's model; every stage's variables and optimizer slots sit on the stage's device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel.parallel import keras_model as km
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe

RTOL = 1e-5
BATCH, STEPS = 16, 3


def assert_close(actual, ref, what="", scale=None):
    """rtol 1e-5; atol 1e-5 of ``scale`` (default: the largest reference value), so that
    weights whose true gradient is zero (attention's key bias) compare as rounding noise."""
    ref = np.asarray(ref, np.float64)
    scale = np.abs(ref).max() if scale is None else scale
    np.testing.assert_allclose(actual, ref, rtol=RTOL, atol=RTOL * max(scale, 1e-30),
                               err_msg=what)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64")
        for n, a in [(16, "relu"), (16, "tanh"), (12, "relu"), (3, None)]])


@keras.saving.register_keras_serializable("accel_tests")
class Block(keras.layers.Layer):
    """A pre-norm transformer block as one layer, residuals inside."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads = width, heads
        self.norm1 = keras.layers.LayerNormalization(dtype=self.dtype_policy)
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads,
                                                    dtype=self.dtype_policy)
        self.norm2 = keras.layers.LayerNormalization(dtype=self.dtype_policy)
        self.up = keras.layers.Dense(2 * width, activation="gelu", dtype=self.dtype_policy)
        self.down = keras.layers.Dense(width, dtype=self.dtype_policy)

    def call(self, x, training=False):
        h = self.norm1(x)
        x = x + self.attn(h, h, training=training)
        return x + self.down(self.up(self.norm2(x)))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "heads": self.heads}


def transformer(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5, 8), dtype="float64"),
        keras.layers.Dense(8, dtype="float64"),
        Block(8, 2, dtype="float64"), Block(8, 2, dtype="float64"),
        keras.layers.GlobalAveragePooling1D(dtype="float64"),
        keras.layers.Dense(3, dtype="float64")])


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 2), dtype="float64"),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", dtype="float64"),
        keras.layers.BatchNormalization(dtype="float64"),
        keras.layers.MaxPooling2D(dtype="float64"),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", dtype="float64"),
        keras.layers.Flatten(dtype="float64"),
        keras.layers.Dense(3, dtype="float64")])


MODELS = {"mlp": mlp, "transformer": transformer, "cnn": cnn}
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(0.01),
              "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)}


def data_for(model, n=BATCH * STEPS, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.inputs[0].shape[1:]))
    return x, rng.normal(size=(n, 3))


def clone(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def keras_fit(model, optimizer, x, y):
    """The reference: Keras's own fit on one device, in order, batch by batch."""
    ref = clone(model)
    # eager: tracing the transformer's train step costs more than the three steps it runs
    ref.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    hist = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return ref, hist.history["loss"][0]


def first_gradients(model, x, y, microbatches=1):
    """d loss / d weights on one device for the first batch; with ``microbatches`` > 1, each
    micro-batch runs through the model on its own (its own BatchNorm statistics)."""
    ref = clone(model)
    loss_fn = keras.losses.MeanSquaredError()
    xb, yb = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])
    with tf.GradientTape() as tape:
        parts = zip(tf.split(xb, microbatches), tf.split(yb, microbatches), strict=True)
        loss = tf.add_n([loss_fn(yk, ref(xk, training=True)) for xk, yk in parts]) / microbatches
    return float(loss), tape.gradient(loss, ref.trainable_weights)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
SLOW = pytest.mark.slow  # several seconds each (eager attention): make test, not make quick
CASES = ([("mlp", s, c, o) for s, c in SCHEDULES for o in sorted(OPTIMIZERS)]
         + [pytest.param("transformer", s, c, "adam", marks=SLOW) for s, c in SCHEDULES]
         + [pytest.param("transformer", "1f1b", 1, "sgd_momentum", marks=SLOW)])


@pytest.mark.parametrize("name,schedule,chunks,opt", CASES)
def test_pipeline_equals_keras_on_one_device(four_devices, name, schedule, chunks, opt):
    model = MODELS[name]()
    x, y = data_for(model)
    before = [w.copy() for w in model.get_weights()]
    ref, _ = keras_fit(model, OPTIMIZERS[opt](), x, y)
    devices = four_devices[:2]
    pipe = pe.Pipeline(model, devices, loss="mse", optimizer=OPTIMIZERS[opt](),
                       num_microbatches=4, schedule=schedule, num_chunks=chunks)
    assert len(pipe.stages) == 2 * chunks
    # every stage's variables (copies) and, after the first step, optimizer slots on its device
    for s, copies in enumerate(pipe.copies):
        assert km.variable_devices(copies) == ({devices[s % 2]} if any(c.weights for c in copies)
                                               else set())

    loss0, grads0 = first_gradients(model, x, y)
    run = pipe.train_step(x[:BATCH], y[:BATCH])
    assert_close(run.loss, loss0, "first loss")
    assert_close(np.concatenate([g.numpy().ravel() for g in sum(run.grads, [])]),
                 np.concatenate([g.numpy().ravel() for g in grads0]), "first gradients")
    slot_devices = {v.path.split("/")[-1]: v.value.device for v in pipe.optimizer.variables}
    assert len(slot_devices) > 2
    for s, copies in enumerate(pipe.copies):
        for w in (w for c in copies for w in c.trainable_weights):
            slots = [v for v in pipe.optimizer.variables if v.path.endswith(
                w.path.replace("/", "_") + "_momentum")]
            assert all(devices[s % 2] in v.value.device for v in slots), w.path

    for k in range(1, STEPS):
        pipe.train_step(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the user's model untouched until write_back
    pipe.write_back()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        assert_close(a, b, f"weight {i} after {STEPS} steps", scale)


def test_fit_writes_back_and_reports_like_keras(four_devices):
    model = mlp(seed=4)
    x, y = data_for(model)
    ref, ref_loss = keras_fit(model, keras.optimizers.Adam(0.01), x, y)
    pipe = pe.Pipeline(model, four_devices[:2], loss=keras.losses.MeanSquaredError(),
                       optimizer=keras.optimizers.Adam(0.01), num_microbatches=2)
    history = pipe.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert isinstance(history, keras.callbacks.History) and history.epoch == [0]
    assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    assert_close(model.predict(x, verbose=0), ref.predict(x, verbose=0), "predictions")


def test_batchnorm_under_microbatches_is_per_microbatch(four_devices):
    """Each micro-batch is normalised by its own statistics: the pipeline equals one device
    running the micro-batches separately (gradients summed, one update), not one device on the
    whole batch. The moving statistics are updated once per micro-batch, in order."""
    model = cnn()
    x, y = data_for(model)
    pipe = pe.Pipeline(model, four_devices[:2], loss="mse", optimizer="sgd",
                       num_microbatches=4, schedule="1f1b")
    run = pipe.train_step(x[:BATCH], y[:BATCH])
    flat = np.concatenate([g.numpy().ravel() for g in sum(run.grads, [])])
    loss_micro, grads_micro = first_gradients(model, x, y, microbatches=4)
    loss_whole, grads_whole = first_gradients(model, x, y, microbatches=1)
    assert_close(run.loss, loss_micro, "loss")
    assert_close(flat, np.concatenate([g.numpy().ravel() for g in grads_micro]), "gradients")
    whole = np.concatenate([g.numpy().ravel() for g in grads_whole])
    assert np.abs(flat - whole).max() > 1e-3 * np.abs(whole).max()  # differs from whole-batch
    # moving statistics: four updates with momentum 0.99, from each micro-batch's mean
    conv = keras.Sequential(model.layers[:1])
    mean = np.zeros(4)
    for xk in np.split(x[:BATCH], 4):
        mean = 0.99 * mean + 0.01 * conv(xk).numpy().mean(axis=(0, 1, 2))
    bn_copy = pipe.copies[0][1] if len(pipe.copies[0]) > 1 else pipe.copies[1][0]
    assert_close(bn_copy.moving_mean.numpy(), mean, "moving mean")


def test_interleaved_is_logged_per_device_in_schedule_order(four_devices):
    model = mlp()
    x, y = data_for(model)
    pipe = pe.Pipeline(model, four_devices[:2], loss="mse", optimizer="adam",
                       num_microbatches=4, schedule="interleaved", num_chunks=2)
    run = pipe.train_step(x[:BATCH], y[:BATCH])
    assert run.orders() == pl.device_orders(pl.interleaved_schedule(4, 2, 2), 2)
    assert len(run.peak_stash) == 4


def test_balance_and_bad_input(four_devices):
    model = mlp()
    devices = four_devices[:2]
    kw = {"loss": "mse", "optimizer": "adam", "num_microbatches": 2}
    assert pe.Pipeline(model, devices, balance=[1, 3], **kw).balance == [1, 3]
    assert pe.Pipeline(model, devices, balance="bytes", **kw).balance == [2, 2]
    with pytest.raises(ValueError, match="must be a keras.Sequential"):
        pe.Pipeline(keras.Model(model.inputs, model.outputs), devices, **kw)
    with pytest.raises(ValueError, match=r"balance \[2, 2\] has 2 stages; this pipeline has 4"):
        pe.Pipeline(model, devices, balance=[2, 2], num_chunks=2, schedule="interleaved", **kw)
    with pytest.raises(ValueError, match="the model has 4 layers, fewer than the 6 stages"):
        pe.Pipeline(model, four_devices[:3], num_chunks=2, schedule="interleaved",
                    loss="mse", optimizer="adam", num_microbatches=3)
    with pytest.raises(ValueError, match="repeat a device"):
        pe.Pipeline(model, [devices[0], devices[0]], **kw)
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        pe.Pipeline(model, devices, loss="mse", optimizer="adamm", num_microbatches=2)
    with pytest.raises(ValueError, match="loss reduction 'sum'"):
        pe.Pipeline(model, devices, loss=keras.losses.MeanSquaredError(reduction="sum"),
                    optimizer="adam", num_microbatches=2)
    with pytest.raises(ValueError, match="recompute=True with layers that hold non-trainable"):
        pe.Pipeline(cnn(), devices, recompute=True, **kw)
    pipe = pe.Pipeline(model, devices, **kw)
    x, y = data_for(model, n=20)
    with pytest.raises(ValueError, match="20 examples in batches of 8 into 2 micro-batches"):
        pipe.fit(x, y, batch_size=8)


def test_recompute_gives_the_same_step(four_devices):
    model = transformer()
    x, y = data_for(model)
    kw = {"loss": "mse", "num_microbatches": 4, "schedule": "gpipe"}
    plain = pe.Pipeline(model, four_devices[:2], optimizer="adam", **kw)
    again = pe.Pipeline(model, four_devices[:2], optimizer="adam", recompute=True, **kw)
    a, b = plain.train_step(x[:BATCH], y[:BATCH]), again.train_step(x[:BATCH], y[:BATCH])
    assert_close(b.loss, a.loss)
    assert_close(np.concatenate([g.numpy().ravel() for g in sum(b.grads, [])]),
                 np.concatenate([g.numpy().ravel() for g in sum(a.grads, [])]))
    assert max(b.peak_stash) == max(a.peak_stash)  # counted micro-batches, not bytes
