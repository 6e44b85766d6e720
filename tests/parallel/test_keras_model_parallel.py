"""accel.parallel.model.ModelParallel on Keras models the library did not build: the split and
the hybrid (replicas x parts, per-part all-reduce) against Keras training the same model on one
device; the parts' variables and optimizer slots on their devices; replicas bitwise equal."""

import keras
import numpy as np
import pytest

from accel.parallel import keras_model as km
from accel.parallel import model as mp
from accel.placement import short_device

SLOW = pytest.mark.slow  # make test, not make quick (each several seconds, or a repeat)
CASES = [("mlp", "split", "adam"), pytest.param("mlp", "split", "sgd_momentum", marks=SLOW),
         ("mlp", "hybrid", "adam"), pytest.param("mlp", "hybrid", "sgd_momentum", marks=SLOW),
         pytest.param("cnn", "split", "adam", marks=SLOW), ("cnn", "split", "sgd_momentum"),
         pytest.param("transformer", "split", "adam", marks=SLOW),
         pytest.param("transformer", "hybrid", "adam", marks=SLOW)]


def layout(devices, form):
    if form == "split":
        return {"devices": devices[:2]}
    return {"replicas": [devices[:2], devices[2:4]]}


@pytest.mark.parametrize("name,form,opt", CASES)
def test_equals_keras_on_one_device(four_devices, keras_zoo, name, form, opt):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    mpar = mp.ModelParallel(model, loss="mse", optimizer=z.OPTIMIZERS[opt](),
                            **layout(four_devices, form))
    for r, devs in enumerate(mpar.replicas):
        for p, copies in enumerate(mpar.copies[r]):
            held = km.variable_devices(copies)
            assert held == ({devs[p]} if any(c.weights for c in copies) else set())

    if name != "transformer":  # tracing attention a second time costs ~5 s: there, the loss
        # and the weights after every step (the pipeline's tests check its gradients) suffice
        loss0, grads0 = z.first_gradients(model, x, y)
        loss, grads = mpar.gradients(x[:z.BATCH], y[:z.BATCH])
        z.assert_close(loss, loss0, "first loss")
        z.assert_close(z.flat(grads), z.flat(grads0), "first gradients")

    history = mpar.fit(x, y, batch_size=z.BATCH, epochs=1, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i} after {z.STEPS} steps", scale)
    # every optimizer slot next to its variable
    for r, optimizer in enumerate(mpar.optimizers):
        devices = {short_device(v.value.device) for v in optimizer.variables
                   if "momentum" in v.path or "velocity" in v.path}
        assert devices == set(mpar.replicas[r])
    if form == "hybrid":  # replicated parts stay bitwise equal: each got the same all-reduce
        for a, b in zip(mpar.variables(0), mpar.variables(1), strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_hybrid_batchnorm_is_per_replica(four_devices, keras_zoo):
    """Each replica normalises its own half of the batch: gradients equal one device running
    the two halves separately (each with its own statistics), not the whole batch."""
    z = keras_zoo
    model = z.MODELS["cnn"]()
    x, y = z.data_for(model)
    mpar = mp.ModelParallel(model, replicas=[four_devices[:2], four_devices[2:]], loss="mse",
                            optimizer="sgd")
    _, grads = mpar.gradients(x[:z.BATCH], y[:z.BATCH])
    _, per_half = z.first_gradients(model, x, y, microbatches=2)
    _, whole = z.first_gradients(model, x, y, microbatches=1)
    z.assert_close(z.flat(grads), z.flat(per_half), "gradients")
    assert np.abs(z.flat(grads) - z.flat(whole)).max() > 1e-3 * np.abs(z.flat(whole)).max()


def test_bad_layouts(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    kw = {"loss": "mse", "optimizer": "adam"}
    d = four_devices
    with pytest.raises(ValueError, match="give devices .one per part. or replicas"):
        mp.ModelParallel(model, d[:2], replicas=[d[:2]], **kw)
    with pytest.raises(ValueError, match="replica 1 lists 1 devices for 2 parts"):
        mp.ModelParallel(model, replicas=[d[:2], d[2:3]], **kw)
    with pytest.raises(ValueError, match="more than once"):
        mp.ModelParallel(model, replicas=[d[:2], d[1:3]], **kw)
    with pytest.raises(ValueError, match="the model has 1 layers, fewer than the 2 parts"):
        mp.ModelParallel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), d[:2],
                         **kw)
    assert mp.ModelParallel(model, d[:2], balance=[3, 1], **kw).balance == [3, 1]
    hybrid = mp.ModelParallel(model, replicas=[d[:2], d[2:]], **kw)
    x, y = keras_zoo.data_for(model, n=30)
    with pytest.raises(ValueError, match=r"30 examples in batches of 15: every batch \(the "
                                         r"last has 15\) must split into 2 equal parts"):
        hybrid.fit(x, y, batch_size=15)
