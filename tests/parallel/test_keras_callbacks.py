"""Keras callbacks in the forms that train outside ``model.fit``
(``accel.parallel.form.Form.fit``): the same callbacks see the same events, the same logs and
the same weights at each epoch's end as under Keras's own ``fit`` of the same model on one
device; ``stop_training`` stops both at the same batch; ``EarlyStopping(restore_best_weights=
True)`` leaves its weights in the model."""

import keras
import numpy as np
import pytest

from accel.parallel.data import DataParallel
from accel.parallel.model import ModelParallel
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.zero import Zero


class Recorder(keras.callbacks.Callback):
    """Every event with its index, the epoch-end loss, and the model's weights at each epoch's
    end; asks to stop after ``stop_at`` = (epoch, batch)."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.events, self.losses, self.weights, self.stop_at = [], [], [], stop_at
        self.epoch = None

    def on_train_begin(self, logs=None):
        self.events.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.events.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", self.epoch, batch))
        if self.stop_at == (self.epoch, batch):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch))
        self.losses.append(logs["loss"])
        self.weights.append(self.model.get_weights())

    def on_train_end(self, logs=None):
        self.events.append(("train_end",))


def form(name, model, devices):
    mse = keras.losses.mean_squared_error
    opt = keras.optimizers.Adam(0.01)
    if name == "towers":
        return DataParallel(model, devices[:2], loss=mse, optimizer=opt)
    if name == "split":
        return ModelParallel(model, devices[:2], loss=mse, optimizer=opt)
    if name == "pipeline":
        return Pipeline(model, devices[:2], loss=mse, optimizer=opt, num_microbatches=2)
    return Zero(model, devices[:2], loss=mse, optimizer=opt, stage=2)


@pytest.mark.parametrize("name", ["towers", *(pytest.param(n, marks=pytest.mark.slow)
                                             for n in ("split", "pipeline", "zero"))])
def test_callbacks_see_what_they_see_under_keras_fit(four_devices, keras_zoo, name):
    z = keras_zoo
    base = z.MODELS["mlp"]()
    x, y = z.data_for(base, n=48)
    ref = z.clone(base)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
    want = Recorder(stop_at=(1, 1))  # epoch 1 stops after its second batch of three
    ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[want])

    model = z.clone(base)
    got = Recorder(stop_at=(1, 1))
    history = form(name, model, four_devices).fit(x, y, batch_size=16, epochs=3, shuffle=False,
                                                  verbose=0, callbacks=[got])
    assert got.events == want.events
    assert got.events[-3:] == [("batch_end", 1, 1), ("epoch_end", 1), ("train_end",)]
    assert history.epoch == [0, 1] and model.history is history
    # Keras logs the epoch's mean loss; so do the forms
    np.testing.assert_allclose(got.losses, history.history["loss"])
    # (Keras's own fit logs the loss of float32 Keras metrics: compare at that precision)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6)
    for epoch, (a, b) in enumerate(zip(got.weights, want.weights, strict=True)):
        scale = max(np.abs(w).max() for w in b)
        for i, (wa, wb) in enumerate(zip(a, b, strict=True)):
            z.assert_close(wa, wb, f"epoch {epoch} weight {i}", scale)


def test_early_stopping_restores_its_best_weights(four_devices, keras_zoo):
    """The restored weights are what the model holds after fit (the final write-back comes
    before on_train_end, so it does not undo the restore)."""
    z = keras_zoo
    base = z.MODELS["mlp"]()
    x, y = z.data_for(base, n=32)
    model = z.clone(base)
    towers = DataParallel(model, four_devices[:2], loss="mse",
                          optimizer=keras.optimizers.Adam(0.01))
    # mode="max": the first epoch is the best and the second, with a lower loss, is not
    stop = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                         restore_best_weights=True)
    rec = Recorder()
    history = towers.fit(x, y, batch_size=16, epochs=6, shuffle=False, verbose=0,
                         callbacks=[rec, stop])
    assert history.epoch == [0, 1] and history.history["loss"][1] < history.history["loss"][0]
    assert stop.best_epoch == 0
    for a, b in zip(model.get_weights(), rec.weights[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(rec.weights[1], rec.weights[0],
                                                        strict=True))
