"""The contract every Keras form keeps, checked over the registry
(``accel.parallel.forms.FORMS``): ``fit`` returns Keras's ``History`` and honours callbacks and
``stop_training``; ``train_step`` returns a dict of logs; the user's optimizer is never built on
the form's variables; the trained weights are written back into the user's model; bad devices
get the same message from every form; Keras's batch and shuffle habits (32 by default, the last
partial batch kept, a new order every epoch unless ``shuffle=False``)."""

import keras
import numpy as np
import pytest

from accel.parallel import forms

# per registry name: devices (indices into four_devices, None for the replicas option) and
# options for a small model of Dense layers named "up" and "down"
SETUPS = {
    "data": ([0, 1], {}),
    "model": ([0, 1], {}),
    "hybrid": (None, {"replicas": [[0, 1], [2, 3]]}),
    "pipeline": ([0, 1], {"num_microbatches": 2}),
    "tensor": ([0, 1], {"rules": {"up$": "column", "down$": "row"}}),
    "zero": ([0, 1], {"stage": 1}),
    "offload": ([0, 1], {"host": 2}),
    "accumulate": ([0], {"accumulation_steps": 2}),
}


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu",
                                                                   name="up"),
                             keras.layers.Dense(2, name="down")])


def _make(name, model, devices, optimizer):
    idx, options = SETUPS[name]
    options = dict(options)
    if "replicas" in options:
        options["replicas"] = [[devices[i] for i in r] for r in options["replicas"]]
    if "host" in options:
        options["host"] = devices[options["host"]]
    form = "model" if name == "hybrid" else name
    return forms.make_form(form, model, None if idx is None else [devices[i] for i in idx],
                           loss="mse", optimizer=optimizer, **options)


def test_the_registry_covers_every_form():
    assert set(forms.FORMS) | {"hybrid"} == set(SETUPS)
    assert all(cls.name == name for name, cls in forms.FORMS.items())


class _Stop(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((batch, logs["loss"]))
        if len(self.batches) == 5:  # the second epoch's second batch
            self.model.stop_training = True


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_contract(four_devices, name):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(12, 4)).astype("float32"), rng.normal(size=(12, 2)).astype("float32")
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    optimizer = keras.optimizers.Adam(0.01)
    form = _make(name, model, four_devices, optimizer)
    logs = form.train_step(x[:4], y[:4])
    assert set(logs) == {"loss"} and isinstance(logs["loss"], float)
    # batches of 32 by default (all 12 here); 5 examples a batch: 5, 5 and the partial 2... kept
    stop = _Stop()
    history = form.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[stop])
    assert isinstance(history, keras.callbacks.History) and model.history is history
    assert history.epoch == [0, 1] and [b for b, _ in stop.batches] == [0, 1, 2, 0, 1]
    assert not optimizer.built and int(optimizer.iterations) == 0  # the user's: never used
    assert all(v.dtype for v in form.working_variables()) and form.optimizer_variables()
    after = model.get_weights()
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(after, before, strict=True))
    # the partial last batch is kept: 10 examples in batches of 4 are 3 steps
    counted = _Stop()
    form.fit(x[:10], y[:10], batch_size=4, epochs=1, verbose=0, callbacks=[counted])
    assert [b for b, _ in counted.batches] == [0, 1, 2]
    default = _Stop()
    form.fit(x, y, epochs=1, verbose=0, callbacks=[default])  # batch_size 32: one batch
    assert [b for b, _ in default.batches] == [0]


@pytest.mark.parametrize("name", list(SETUPS))
def test_one_device_rule(four_devices, name):
    model = _model()
    twice = [four_devices[0], "/cpu:0"]  # the same device in two spellings
    form = "model" if name == "hybrid" else name
    options = dict(SETUPS[name][1])
    options.pop("replicas", None)
    if "host" in options:
        options["host"] = four_devices[2]
    for devices, message in ((twice, r"name \['/device:CPU:0'\] more than once"),
                             ([], "devices is empty")):
        with pytest.raises(ValueError, match=message):
            forms.make_form(form, model, devices, loss="mse", optimizer="sgd", **options)


def test_shuffle_each_epoch_unless_told(four_devices):
    """Keras's default: a new order every epoch (NumPy's global generator, which
    keras.utils.set_random_seed seeds); shuffle=False keeps the data's order."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    losses = {}
    for shuffle in (True, False, None):
        model = _model()
        towers = forms.make_form("data", model, four_devices[:2], loss="mse", optimizer="sgd")
        keras.utils.set_random_seed(3)
        kwargs = {} if shuffle is None else {"shuffle": shuffle}
        losses[shuffle] = towers.fit(x, y, batch_size=4, epochs=2, verbose=0,
                                     **kwargs).history["loss"]
    assert losses[None] == losses[True]  # the default shuffles
    assert losses[True] != losses[False]
