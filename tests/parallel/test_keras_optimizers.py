"""AdamW, RMSprop and Adagrad in every Keras form that applies the optimizer itself (Adam and SGD
with Nesterov momentum are in each form's own tests; under MirroredStrategy Keras's own fit
applies it): the MLP trained two steps by each form equals Keras's own fit on one device with
the same optimizer; and the optimizers a sharded form cannot apply slice by slice are refused by
tensor parallelism as by ZeRO."""

import keras
import numpy as np
import pytest

from accel.parallel.data import DataParallel
from accel.parallel.model import ModelParallel
from accel.parallel.offload import Offload
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.tensor import TensorParallel
from accel.parallel.zero import Zero

OPTIMIZERS = {
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
}
NAMES = ("up1", "down1", "up2", "down2")  # Megatron pairs for tensor parallelism


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64", name=name)
        for (n, a), name in zip([(16, "relu"), (16, "tanh"), (12, "relu"), (3, None)], NAMES,
                                strict=True)])


def train(form, model, make, devices, x, y):
    """``model`` trained on ``x, y`` (2 batches of 16) by ``form``; the trained weights."""
    mse = keras.losses.mean_squared_error
    if form == "towers":
        DataParallel(model, devices[:2], loss=mse, optimizer=make()).fit(x, y, 16, shuffle=False,
                                                                         verbose=0)
    elif form == "split":
        ModelParallel(model, devices[:2], loss=mse, optimizer=make()).fit(x, y, 16, shuffle=False,
                                                                          verbose=0)
    elif form == "hybrid":
        ModelParallel(model, replicas=[devices[:2], devices[2:4]], loss=mse,
                      optimizer=make()).fit(x, y, 16, shuffle=False, verbose=0)
    elif form == "pipeline":
        Pipeline(model, devices[:2], loss=mse, optimizer=make(), num_microbatches=2,
                 schedule="1f1b").fit(x, y, 16, shuffle=False, verbose=0)
    elif form == "zero3":
        Zero(model, devices[:2], loss=mse, optimizer=make(), stage=3).fit(x, y, 16, shuffle=False,
                                                                          verbose=0)
    elif form == "offload":
        Offload(model, devices[:2], host=devices[2], loss=mse,
                optimizer=make()).fit(x, y, 16, shuffle=False, verbose=0)
    elif form == "tensor":
        tp = TensorParallel(model, devices[:2], {"^up": "column", "^down": "row"})
        tp.compile(make(), "mse", run_eagerly=True)
        tp.model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        tp.write_back()
    return model.get_weights()


FORMS = ["towers", "split", "hybrid", "pipeline", "zero3", "offload", "tensor"]


@pytest.mark.slow
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_every_form_equals_keras_on_one_device(four_devices, keras_zoo, opt):
    z = keras_zoo
    base = mlp()
    x, y = z.data_for(base, n=32)
    ref, _ = z.keras_fit(base, OPTIMIZERS[opt](), x, y)
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for form in FORMS:
        got = train(form, z.clone(base), OPTIMIZERS[opt], four_devices, x, y)
        for i, (a, b) in enumerate(zip(got, ref.get_weights(), strict=True)):
            z.assert_close(a, b, f"{form} {opt}: weight {i}", scale)


@pytest.mark.parametrize("optimizer, message", [
    (keras.optimizers.Lamb(0.01), "optimizer Lamb is not supported .* update must be per element"),
    (keras.optimizers.Adam(0.01, clipnorm=1.0), "clipnorm=1.0 .* clips each variable by its own"),
])
def test_tensor_parallel_refuses_what_a_shard_cannot_apply(four_devices, optimizer, message):
    tp = TensorParallel(mlp(), four_devices[:2], {"^up": "column", "^down": "row"})
    with pytest.raises(ValueError, match=message):
        tp.compile(optimizer, "mse")
