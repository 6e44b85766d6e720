"""accel.parallel.pipeline_exec.Pipeline on Keras models the library did not build, checked
against Keras training the same model on one device (same optimizer, same data): losses,
gradients of the first step and weights after several steps; the trained weights end up in the
user's model; every stage's variables and optimizer slots sit on the stage's device."""

import keras
import numpy as np
import pytest

from accel.parallel import keras_model as km
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]
SLOW = pytest.mark.slow  # several seconds each (eager attention): make test, not make quick
QUICK = {("1f1b", "adam"), ("interleaved", "adam")}  # the rest: make test, not make quick
CASES = ([pytest.param("mlp", s, c, o, marks=() if (s, o) in QUICK else SLOW)
          for s, c in SCHEDULES for o in ("adam", "sgd_momentum")]
         + [pytest.param("transformer", s, c, "adam", marks=SLOW) for s, c in SCHEDULES])


@pytest.mark.parametrize("name,schedule,chunks,opt", CASES)
def test_pipeline_equals_keras_on_one_device(four_devices, keras_zoo, name, schedule, chunks,
                                              opt):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    before = [w.copy() for w in model.get_weights()]
    ref, _ = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    devices = four_devices[:2]
    pipe = pe.Pipeline(model, devices, loss="mse", optimizer=z.OPTIMIZERS[opt](),
                       num_microbatches=4, schedule=schedule, num_chunks=chunks)
    assert len(pipe.stages) == 2 * chunks
    # every stage's variables (copies) and, after the first step, optimizer slots on its device
    for s, copies in enumerate(pipe.copies):
        assert km.variable_devices(copies) == ({devices[s % 2]} if any(c.weights for c in copies)
                                               else set())

    loss0, grads0 = z.first_gradients(model, x, y)
    run = pipe.run_step(x[:z.BATCH], y[:z.BATCH])
    z.assert_close(run.loss, loss0, "first loss")
    z.assert_close(z.flat(sum(run.grads, [])), z.flat(grads0), "first gradients")
    slot_devices = {v.path.split("/")[-1]: v.value.device for v in pipe.optimizer.variables}
    assert len(slot_devices) > 2
    for s, copies in enumerate(pipe.copies):
        for w in (w for c in copies for w in c.trainable_weights):
            slots = [v for v in pipe.optimizer.variables if v.path.endswith(
                w.path.replace("/", "_") + "_momentum")]
            assert all(devices[s % 2] in v.value.device for v in slots), w.path

    b = z.BATCH
    for k in range(1, z.STEPS):
        pipe.run_step(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b])
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the user's model untouched until write_back
    pipe.write_back()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i} after {z.STEPS} steps", scale)


def test_fit_writes_back_and_reports_like_keras(four_devices, keras_zoo):
    z = keras_zoo
    model = z.MODELS["mlp"](seed=4)
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, keras.optimizers.Adam(0.01), x, y)
    pipe = pe.Pipeline(model, four_devices[:2], loss=keras.losses.MeanSquaredError(),
                       optimizer=keras.optimizers.Adam(0.01), num_microbatches=2)
    history = pipe.fit(x, y, batch_size=z.BATCH, epochs=1, shuffle=False, verbose=0)
    assert isinstance(history, keras.callbacks.History) and history.epoch == [0]
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    z.assert_close(model.predict(x, verbose=0), ref.predict(x, verbose=0), "predictions")


def test_batchnorm_under_microbatches_is_per_microbatch(four_devices, keras_zoo):
    """Each micro-batch is normalised by its own statistics: the pipeline equals one device
    running the micro-batches separately (gradients summed, one update), not one device on the
    whole batch. The moving statistics are updated once per micro-batch, in order."""
    z = keras_zoo
    model = z.MODELS["cnn"]()
    x, y = z.data_for(model)
    pipe = pe.Pipeline(model, four_devices[:2], loss="mse", optimizer="sgd",
                       num_microbatches=4, schedule="1f1b")
    run = pipe.run_step(x[:z.BATCH], y[:z.BATCH])
    got = z.flat(sum(run.grads, []))
    loss_micro, grads_micro = z.first_gradients(model, x, y, microbatches=4)
    _, grads_whole = z.first_gradients(model, x, y, microbatches=1)
    z.assert_close(run.loss, loss_micro, "loss")
    z.assert_close(got, z.flat(grads_micro), "gradients")
    whole = z.flat(grads_whole)
    assert np.abs(got - whole).max() > 1e-3 * np.abs(whole).max()  # differs from whole-batch
    # moving statistics: four updates with momentum 0.99, from each micro-batch's mean
    conv = keras.Sequential(model.layers[:1])
    mean = np.zeros(4)
    for xk in np.split(x[:z.BATCH], 4):
        mean = 0.99 * mean + 0.01 * conv(xk).numpy().mean(axis=(0, 1, 2))
    bn_copy = pipe.copies[0][1] if len(pipe.copies[0]) > 1 else pipe.copies[1][0]
    z.assert_close(bn_copy.moving_mean.numpy(), mean, "moving mean")


def test_interleaved_is_logged_per_device_in_schedule_order(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    x, y = keras_zoo.data_for(model)
    pipe = pe.Pipeline(model, four_devices[:2], loss="mse", optimizer="adam",
                       num_microbatches=4, schedule="interleaved", num_chunks=2)
    run = pipe.run_step(x[:16], y[:16])
    assert run.orders() == pl.device_orders(pl.interleaved_schedule(4, 2, 2), 2)
    assert len(run.peak_stash) == 4


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_balance_and_bad_input(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    devices = four_devices[:2]
    kw = {"loss": "mse", "optimizer": "adam", "num_microbatches": 2}
    assert pe.Pipeline(model, devices, balance=[1, 3], **kw).balance == [1, 3]
    assert pe.Pipeline(model, devices, balance="bytes", **kw).balance == [2, 2]
    subclassed = _Subclassed()
    subclassed(np.zeros((1, 6)))
    with pytest.raises(ValueError, match="subclassed model: .* as a functional model .* the "
                                         "data-parallel forms"):
        pe.Pipeline(subclassed, devices, **kw)
    with pytest.raises(ValueError, match=r"balance \[2, 2\] has 2 parts; this form cuts the "
                                         "model into 4"):
        pe.Pipeline(model, devices, balance=[2, 2], num_chunks=2, schedule="interleaved", **kw)
    with pytest.raises(ValueError, match="the model has 4 layers, fewer than the 6 parts"):
        pe.Pipeline(model, four_devices[:3], num_chunks=2, schedule="interleaved",
                    loss="mse", optimizer="adam", num_microbatches=3)
    with pytest.raises(ValueError, match="more than once"):
        pe.Pipeline(model, [devices[0], devices[0]], **kw)
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        pe.Pipeline(model, devices, loss="mse", optimizer="adamm", num_microbatches=2)
    with pytest.raises(ValueError, match="loss reduction 'sum'"):
        pe.Pipeline(model, devices, loss=keras.losses.MeanSquaredError(reduction="sum"),
                    optimizer="adam", num_microbatches=2)
    with pytest.raises(ValueError, match="recompute=True with layers that hold non-trainable"):
        pe.Pipeline(keras_zoo.MODELS["cnn"](), devices, recompute=True, **kw)
    dropout = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dropout(
        0.5, name="drop"), keras.layers.Dense(4), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"\['drop'\]: moving statistics or a random seed"):
        pe.Pipeline(dropout, devices, recompute=True, **kw)  # a second forward, another mask
    pipe = pe.Pipeline(model, devices, **kw)
    x, y = keras_zoo.data_for(model, n=21)  # as Keras, the last, partial batch is kept...
    with pytest.raises(ValueError, match=r"21 examples in batches of 8: every batch \(the last "
                                         r"has 5\) must split into 2 equal parts"):
        pipe.fit(x, y, batch_size=8)  # ... when it splits into the micro-batches


def test_recompute_gives_the_same_step(four_devices, keras_zoo):
    z = keras_zoo
    model = z.MODELS["mlp"]()
    x, y = z.data_for(model)
    kw = {"loss": "mse", "num_microbatches": 4, "schedule": "gpipe"}
    plain = pe.Pipeline(model, four_devices[:2], optimizer="adam", **kw)
    again = pe.Pipeline(model, four_devices[:2], optimizer="adam", recompute=True, **kw)
    a, b = plain.run_step(x[:16], y[:16]), again.run_step(x[:16], y[:16])
    z.assert_close(b.loss, a.loss)
    z.assert_close(z.flat(sum(b.grads, [])), z.flat(sum(a.grads, [])))
    assert max(b.peak_stash) == max(a.peak_stash)  # counted micro-batches, not bytes
